"""`dspark train`: the training loop, single process or DDP under torchrun, resumable.

    dspark train --cache runs/x/cache --output runs/x/train
    dspark train --online --responses runs/x/responses --output runs/x/train    # no cache
    torchrun --nproc_per_node 8 -m dspark_cli.cli train --cache s3://b/cache --output s3://b/train

The loop reads in the order it runs: lr → micro-steps (forward, backward; DDP syncs on the last)
→ clip → step → log → checkpoint. Rank 0 does the I/O; every rank writes its RNG state into the
checkpoint before rank 0 commits it. The data position is the step number (train/data.py), so a
resumed run continues with exactly the samples and anchors an uninterrupted run would have seen.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import storage
from ..config import PipelineConfig
from ..console import console
from ..errors import ConfigError, DsparkError, StageConflictError
from ..manifest import fingerprint, prepare_stage, read_manifest
from ..model.attention import step_mask, use_flex
from ..model.backbone_init import init_backbone_from_target
from ..model.card import refresh_card
from ..model.config import DrafterConfig
from ..model.drafter import DSparkDrafter
from ..model.export import export_drafter
from ..model.frozen import attach_frozen
from ..model.init_gain import OutputGain, describe_gain, set_output_gain
from ..model.markov_init import init_markov_rows
from ..sample import Sample
from ..settings.train import CONFIDENCE_HEAD_KEYS, EARLIER_BEHAVIOUR, MARKOV_HEAD_KEYS, RUNTIME_KEYS
from ..stage import StageResult, already_done, completed
from ..target.dtypes import bf16_autocast, resolve_device
from ..target.files import load_config, num_layers
from ..target.identity import config_hash
from ..target.layers import agree_layers, resolve_layers
from . import checkpoint as ckpt
from . import vocab_kernel
from .confidence_bias import flatten_slots, held_out_shift
from .data import BatchMaker, StepPlan, plan_items
from .draft_vocab import choose_draft_vocab, describe, split_token_counts
from .host_memory import keep_freed_memory
from .loss import DRAFT_VOCAB_NEEDS_FAST_KERNELS, DrafterLoss, LossWeights, summarize
from .metrics import MetricsLog
from .prefetch import Prefetcher
from .validate import evaluate

STAGE = "train"


@dataclass
class Dist:
    """This process's place in a torchrun launch (world 1 when launched plainly)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, device_type: str) -> Dist:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        return cls(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t


def autocast_for(precision: str, device: torch.device) -> Any:
    """bf16 autocast where asked for, or with 'auto' where bf16 matmuls are native; else full precision."""
    if not bf16_autocast(precision, device):
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to the peak, then cosine down to min_ratio of it."""
    warmup = int(round(warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def param_groups(drafter: DSparkDrafter, lr: float, norm_scale: float = 1.0,
                 markov_scale: float = 1.0) -> list[dict[str, Any]]:
    """The trainable weights; the final norm and the Markov head's W1/W2 each in a group of their own
    when their lr is scaled (one group otherwise, the layout earlier checkpoints were saved with)."""
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    scaled: list[tuple[list[torch.nn.Parameter], float]] = []
    if norm_scale != 1.0:
        scaled.append(([drafter.norm.weight], norm_scale))
    if markov_scale != 1.0 and drafter.markov_head is not None:  # its vocabulary tables, not a gate
        head = drafter.markov_head
        scaled.append(([head.markov_w1.weight, head.markov_w2.weight], markov_scale))
    if not scaled:
        return [{"params": trainable}]
    own = {id(p) for params, _ in scaled for p in params}
    return [{"params": [p for p in trainable if id(p) not in own]},
            *({"params": params, "lr": lr * scale} for params, scale in scaled)]


def drafter_config_for(cfg: PipelineConfig, meta: dict[str, Any]) -> DrafterConfig:
    """Architecture from the target config + [model] + the layers (the cache's, when it has any)."""
    target = cfg.target.model or meta.get("target", "")
    if not target:
        raise DsparkError("no target model: set target.model (the folder or id the cache was built from).")
    target_config = load_config(target, cfg.target.revision, cfg.target.trust_remote_code)
    built_for = meta.get("target") or "?"
    if meta.get("target_config_hash") and config_hash(target_config) != meta["target_config_hash"]:
        raise DsparkError(f"the cache was built for another target ({built_for}), not {target} "
                          "(their configs differ).",
                          hint=f"train with --target {built_for}, or build a cache for {target}.")
    if meta.get("layers"):
        layers = agree_layers(cfg.target.layers, list(meta["layers"]), "the cache")
    else:  # a caller-supplied dataset: what `cache build` would have resolved
        layers = resolve_layers(cfg.target.layers, num_layers(target_config))
    config = DrafterConfig.from_target(target_config, layers=layers, mask_token_id=cfg.target.mask_token_id,
                                       model_settings=cfg.model, target_model=target)
    if meta.get("hidden_size") and int(meta["hidden_size"]) != config.hidden_size:
        raise DsparkError(f"the cache's hidden size {meta['hidden_size']} differs from the target's "
                          f"{config.hidden_size} ({target}).")
    return config


def train(cfg: PipelineConfig, cache_url: str, output_url: str, force: bool = False,
          dataset: Sequence[Sample] | None = None, validation: Sequence[Sample] | None = None,
          on_step_end: Callable[[int, dict[str, Any]], None] | None = None,
          open_split: Callable[[str], Sequence[Sample]] | None = None) -> StageResult:
    """Train (or resume) a drafter. Off rank 0 the result has no manifest and an empty summary
    (rank 0 commits and reports).

    `open_split(split)` opens a split of the input at `cache_url`: the cache reader (the command
    passes it; train imports no other stage), or with `train.source = "online"` an
    `online.OnlineSource` over the responses at that URL. `dataset` / `validation` replace those
    splits (any sequences of `Sample`s); `on_step_end(step, record)` is called after every
    optimizer step (monitoring, tests).
    """
    tc = cfg.train
    device_type = resolve_device(tc.device, 0).type
    world = Dist.from_env(device_type)
    device = resolve_device(tc.device, world.local_rank)
    supplied = dataset is not None
    if dataset is None:
        if open_split is None:
            raise DsparkError("train: no dataset and no cache reader given.")
        dataset = open_split("train")
    meta = dict(getattr(dataset, "meta", {}) or {})
    dcfg = drafter_config_for(cfg, meta)

    online = meta.get("source") == "online"

    # The resolved layers, not the spelling: "auto" and the cache's ids are the same run. Keys
    # that only change speed stay out, so do `source` and `online` for a cache-fed run (a run of
    # the release before them still resumes).
    train_config = {k: v for k, v in tc.stage_dict().items() if k not in (*RUNTIME_KEYS, "source")}
    # Keys of a head the drafter lacks: a DFlash baseline's run is unchanged by them.
    absent = ((() if dcfg.enable_confidence_head else CONFIDENCE_HEAD_KEYS)
              + (MARKOV_HEAD_KEYS if dcfg.markov_head_type == "none" else ()))
    for key in absent:
        train_config.pop(key, None)
    model_config = cfg.model.to_dict()
    if not model_config["draft_vocab_size"]:  # the full vocabulary: a run of the release before resumes
        del model_config["draft_vocab_size"]
    if dcfg.draft_vocab_size and online:
        raise ConfigError("model.draft_vocab_size needs a cache-fed run: its tokens are counted from the "
                          "cache's responses (train.source = cache).")
    if dcfg.draft_vocab_size and not tc.fast_kernels:  # before the claim, not at the loss
        raise ConfigError(DRAFT_VOCAB_NEEDS_FAST_KERNELS)
    stage_config = {"target": {**cfg.target.to_dict(), "layers": list(dcfg.target_layer_ids)},
                    "model": model_config, "train": train_config}
    if online:  # what `cache build` would have recorded about rendering
        stage_config["online"] = {"max_length": cfg.cache.max_length,
                                  "min_loss_tokens": cfg.cache.min_loss_tokens}
    if supplied:  # a caller-supplied dataset has no artifact to fingerprint; its URL is only a label
        inputs = {cache_url: f"dataset:{len(dataset)}"}
    elif online:  # the responses, and the target whose forwards are the features
        inputs = dataset.stage_inputs()
    else:
        inputs = {cache_url: fingerprint(cache_url)}
    init_gain: OutputGain | None = None
    backbone_init: dict[str, Any] | None = None

    def build_drafter(resuming: bool) -> DSparkDrafter:
        """resuming: a checkpoint of this run will be loaded (its own draft vocabulary with it)."""
        nonlocal init_gain, backbone_init
        torch.manual_seed(tc.seed)
        built = DSparkDrafter(dcfg)
        attach_frozen(built, dcfg.target_model)  # reads the target's embedding: the stage's probe
        init_gain = set_output_gain(built, tc.init_output_gain, dataset)  # a resume then loads its own
        init_markov_rows(built.markov_head, built.embed_tokens.weight, tc.markov_init)
        if tc.backbone_init == "target":
            backbone_init = init_backbone_from_target(built, dcfg.target_model, dataset)
            console.print(f"  layers, fc and norms from target layers {backbone_init['source_layers']} "
                          f"(q/k norms: {backbone_init['qk_norm']})")
        if dcfg.draft_vocab_size and not resuming:
            counts = split_token_counts(dataset, dcfg.vocab_size)
            built.draft_token_ids.copy_(choose_draft_vocab(counts, dcfg.draft_vocab_size))
            console.print(f"  draft vocabulary: {describe(counts, built.draft_token_ids)}")
        return built

    drafter = None
    if world.main:
        run = prepare_train_stage(output_url, stage_config, inputs, force)
        if run.state != "done":
            # before the claim: a wrong target leaves nothing behind (--force's old checkpoints included)
            drafter = build_drafter(run.state == "resume" and ckpt.latest_checkpoint(output_url) is not None)
            run.claim()
    world.barrier()
    if not world.main:
        run = prepare_stage(STAGE, output_url, stage_config, inputs, force=False)
    if run.state == "done":
        return already_done(run, summary) if world.main else StageResult(run.stage, "done", output_url)

    plan = StepPlan(len(dataset), tc.global_batch, tc.micro_batch, world.world_size, world.rank, tc.seed)
    total_steps = tc.max_steps or tc.epochs * plan.steps_per_epoch

    drafter = drafter or build_drafter(ckpt.latest_checkpoint(output_url) is not None)  # after the claim
    drafter.to(device)
    if tc.fast_kernels and device.type == "cpu":
        keep_freed_memory()
    weights = LossWeights(tc.ce_weight, tc.tv_weight, tc.conf_weight, tc.gamma_decay)
    compile_vocab = vocab_kernel.wanted(tc.compile_vocab, device, bf16_autocast(tc.precision, device))
    module: torch.nn.Module = DrafterLoss(drafter, weights, tc.loss_chunk_blocks,
                                          detach_confidence_inputs=tc.detach_confidence_inputs,
                                          fast_kernels=tc.fast_kernels, compile_vocab=compile_vocab)
    if world.world_size > 1:
        module = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None)
    groups = param_groups(drafter, tc.lr, tc.output_norm_lr_scale, tc.markov_lr_scale)
    params = [p for group in groups for p in group["params"]]
    # fused: one pass over each parameter (train.fast_kernels); the per-tensor loop it replaces
    # made a dozen passes over W1 and W2 ([V, r] each), 0.31 s a step against 0.03 on 2 cores.
    optimizer = torch.optim.AdamW(groups, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95),
                                  fused=tc.fast_kernels or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, tc.warmup_ratio,
                                                                       tc.min_lr_ratio))
    start_step = 0
    resumed = ckpt.resume_checkpoint(output_url, drafter, optimizer, scheduler, world.rank)
    if resumed is not None:
        latest, state = resumed
        start_step = int(state["step"])
        if world.main:
            console.print(f"[yellow]↻[/] train: resuming from {latest} (step {start_step}/{total_steps}).")
    elif world.main:
        console.print(f"[cyan]▶[/] train: {total_steps} steps × {tc.global_batch} samples on "
                      f"{world.world_size} rank(s), {device}; writing {output_url}.")
        if backbone_init is None:  # else the final norm is the target's (printed with the layers)
            console.print(f"  final-norm gain at init {describe_gain(init_gain)}")
    if world.main:
        storage.clean_temporaries(output_url)  # orphans of a killed local writer
    log = MetricsLog(output_url, start_step, enabled=world.main)
    flex = use_flex(device)
    started = time.time()
    record: dict[str, Any] = {}
    # The next micro-batches are made in the background (online: the target's forwards).
    batches = Prefetcher(BatchMaker(dataset, plan, tc.num_anchors, tc.seed, dcfg),
                         plan_items(plan, start_step, total_steps), depth=tc.prefetch_batches)
    try:
        for step in range(start_step, total_steps):
            t0 = time.time()
            lr = scheduler.get_last_lr()[0]
            totals: dict[str, torch.Tensor] = {}
            target_s = wait_s = 0.0
            module.train()
            for i in range(plan.accumulation):
                waited = time.perf_counter()
                micro = next(batches)
                wait_s += time.perf_counter() - waited
                target_s += micro.target_s
                assert micro.step == step, (micro.step, step)
                epoch, batch = micro.epoch, micro.batch.to(device)
                mask = step_mask(batch.layout, flex, split=tc.fast_kernels)
                last = i == plan.accumulation - 1
                sync = nullcontext() if (last or world.world_size == 1) else module.no_sync()
                with sync:
                    with autocast_for(tc.precision, device):
                        loss, stats = module(batch, mask)
                    (loss / plan.accumulation).backward()
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0) + v.float().cpu()
            grad_norm = (torch.nn.utils.clip_grad_norm_(params, tc.grad_clip, foreach=tc.fast_kernels or None)
                         if tc.grad_clip > 0 else None)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            # Means over the global batch: loss terms are per-micro-batch means; slot sums add up.
            for k in ("loss", "ce", "tv", "conf_bce"):
                totals[k] = totals[k] / plan.accumulation / world.world_size
            packed = torch.cat([totals[k].reshape(-1) for k in sorted(totals)])
            packed = world.all_sum(packed.to(device)).cpu()  # NCCL reduces CUDA tensors only
            offset = 0
            for k in sorted(totals):
                n = totals[k].numel()
                totals[k] = packed[offset:offset + n].reshape(totals[k].shape)
                offset += n
            elapsed = time.time() - t0
            record = {"step": step + 1, "total_steps": total_steps, "epoch": epoch, "lr": lr,
                      **summarize(totals, drafter.confidence_head is not None),
                      "grad_norm": float(grad_norm) if grad_norm is not None else None,
                      "anchor_slots": int(totals["blocks"]) * dcfg.block_size,
                      "tokens_per_s": float(totals["blocks"]) * dcfg.block_size / max(elapsed, 1e-9),
                      "elapsed_s": round(time.time() - started, 3),
                      # this rank's split of the step: the drafter's work, and waiting for batches
                      "drafter_s": round(max(0.0, elapsed - wait_s), 4), "data_wait_s": round(wait_s, 4)}
            if online:
                record["target_s"] = round(target_s, 4)  # the target's forwards for this step's batches
            if (step + 1) % tc.log_every == 0 or step + 1 == total_steps or step == start_step:
                log.log(record)
            if (step + 1) % tc.save_every == 0 or step + 1 == total_steps:
                ckpt.save_rng(output_url, step + 1, world.rank)
                world.barrier()
                if world.main:
                    ckpt.save_checkpoint(output_url, step + 1, drafter, optimizer, scheduler,
                                         {"epoch": epoch, "total_steps": total_steps}, tc.keep_last)
                world.barrier()
            if on_step_end is not None:
                on_step_end(step + 1, record)
    finally:
        batches.close()  # on every exit path: no prefetch thread outlives the loop
    log.close()

    manifest = None
    held_out = None
    confidence_slots: list = []
    if world.main and tc.eval_samples > 0:
        if validation is None and not supplied:
            validation = open_split("validation") if open_split is not None else None
        if validation is not None and len(validation) > 0:
            held_out = evaluate(module.module if world.world_size > 1 else module, validation, dcfg,
                                num_anchors=tc.num_anchors, seed=tc.seed, micro_batch=tc.micro_batch,
                                limit=tc.eval_samples, device=device, flex=flex,
                                confidence_out=confidence_slots)
            console.print(f"validation ({held_out['samples']} samples): loss {held_out['loss']:.4f}  "
                          f"τ {held_out['accepted_length']:.2f}  acceptance {held_out['slot_acceptance']}")
    confidence_bias = None
    if world.main and tc.fit_confidence_bias and drafter.confidence_head is not None:
        confidence_bias = refit_confidence_bias(drafter, confidence_slots, held_out)
    if world.main:
        export_url = storage.join(output_url, "export")
        export_drafter(drafter, export_url, include_embeddings=tc.export_include_embeddings,
                       dtype=tc.export_dtype)
        final = ckpt.latest_checkpoint(output_url)
        manifest = run.finish(
            counts={"steps": total_steps, "samples_seen": total_steps * tc.global_batch,
                    "train_samples": len(dataset)},
            extra={"drafter_config": dcfg.to_dict(), "export": export_url, "checkpoint": final,
                   "world_size": world.world_size, "final_metrics": record, "validation": held_out,
                   "init_output_gain": init_gain.to_dict() if init_gain else None,
                   **({"backbone_init": backbone_init} if backbone_init else {}),
                   "confidence_bias": confidence_bias,
                   **({"online": dataset.report()} if online else {})},
        )
        console.print(f"[green]✓[/] train: exported {export_url}")
        engines = refresh_card(export_url)  # README.md + the engines check (docs/engines.md)
        if engines:
            console.print(engines)
    world.barrier()
    if world.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    return completed(run, manifest, summary(manifest) if manifest is not None else {})


def prepare_train_stage(output_url: str, stage_config: dict[str, Any], inputs: dict[str, str],
                        force: bool) -> Any:
    """prepare_stage, whose refusal of a run that left a key out (made by an earlier release, or at
    the value that reproduces one) names the --set that keeps that run."""
    try:
        return prepare_stage(STAGE, output_url, stage_config, inputs, force=force)
    except StageConflictError as e:
        recorded = ((read_manifest(output_url) or {}).get("config") or {}).get("train") or {}
        kept = [f"train.{k}={str(v).lower()}" for k, v in EARLIER_BEHAVIOUR.items()
                if f"train.{k}" in e.config_keys and k not in recorded]
        if not kept:
            raise
        raise StageConflictError(str(e), hint=f"that run was made at {', '.join(kept)} (the earlier "
                                 f"behaviour, which its config leaves out): --set it to keep that run, or "
                                 f"rerun with --force to retrain.", config_keys=e.config_keys) from None


def refit_confidence_bias(drafter: DSparkDrafter, slots: list, held_out: dict[str, Any] | None
                          ) -> dict[str, Any]:
    """Shift the confidence head's bias to the held-out slots' acceptance (train/confidence_bias.py);
    what the manifest records: the shift and its effect, or why there was none."""
    if not slots:
        console.print("[yellow]![/] train: no validation samples scored (train.eval_samples = 0 or no "
                      "validation split): the confidence head keeps its trained bias.")
        return {"skipped": "no validation samples"}
    try:
        shift = held_out_shift(drafter, *flatten_slots(slots))
    except ValueError as e:  # a symptom of a broken split; the trained head is still a valid head
        console.print(f"[yellow]![/] train: {e}; the confidence head keeps its trained bias.")
        return {"skipped": str(e)}
    console.print(f"  confidence bias refitted on {held_out['samples']} validation samples: "
                  f"{shift.shift:+.3f} (mean confidence {shift.mean_confidence_before:.3f} → "
                  f"{shift.mean_confidence_after:.3f}, held-out c* {shift.mean_target:.3f})")
    return {**shift.to_dict(), "samples": held_out["samples"]}


def summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """What `dspark train` prints: the exported drafter, its steps and last training figures."""
    final = manifest["extra"].get("final_metrics") or {}
    return {"export": manifest["extra"]["export"], "steps": manifest["counts"]["steps"],
            "loss": final.get("loss"), "accepted_length": final.get("accepted_length")}
