"""The plan for one config on one cluster: memory per rank, FLOPs, cache bytes, wall time, and
what to change when it does not fit. Every figure comes from flops.py / memory.py; this module
only combines them for the run the config describes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..cache.estimate import EXPECTED_RATIO
from ..cache.store import layout_bytes
from ..config import PipelineConfig
from ..model.config import DrafterConfig
from ..target.dtypes import auto_dtype, cpu_has_fast_bf16, torch_dtype
from . import memory
from .flops import StepFlops, micro_batch_flops
from .shapes import TargetShape, shapes

#: Open-PerfectBlend's row count: the default data size when the config's data is not measured yet.
OPEN_PERFECTBLEND_ROWS = 1_420_909
GiB = 2**30


@dataclass(frozen=True)
class Data:
    """The training data as the plan sees it (measured from a cache, or stated)."""

    samples: int
    tokens_per_sample: int
    loss_tokens_per_sample: int
    origin: str


@dataclass(frozen=True)
class Cluster:
    gpus: int = 8
    memory_gib: float = 80.0
    #: Sustained bf16 FLOP/s per GPU the wall time is stated at (not the datasheet peak).
    tflops: float = 300.0
    device_type: str = "cuda"
    #: Share of the device memory a run may plan to use (allocator, fragmentation, NCCL).
    usable: float = 0.9


@dataclass
class Memory:
    """Per-rank peak bytes, by term (memory.py's docstring)."""

    states: int
    gradients: int
    frozen: int
    activations: int
    transient: int
    batches: int
    online_target: int
    runtime: int
    ddp_buckets: int
    #: A checkpoint's AdamW moments serialised in host memory before the write (train/checkpoint.py);
    #: counted where host memory is the device's (CPU), 0 for a GPU's own memory.
    checkpoint: int = 0
    #: Decoded cache samples the reader keeps (train.cache_memory_mb, at most the split's size):
    #: host memory, so counted where it is the device's (CPU) and for the cache source only.
    kept: int = 0

    @property
    def peak(self) -> int:
        static = (self.runtime + self.frozen + self.batches + self.online_target + self.ddp_buckets
                  + self.kept)
        return static + max(self.states + self.activations + self.transient, self.states + self.gradients,
                            self.states + self.checkpoint)


@dataclass
class SourcePlan:
    source: str
    memory: Memory
    peak_gib: float
    fits: bool
    flops_per_step: float
    flops_per_epoch: float
    hours: float


@dataclass
class Plan:
    target: dict[str, Any]
    drafter: dict[str, Any]
    data: dict[str, Any]
    cluster: dict[str, Any]
    parameters: dict[str, int]
    steps_per_epoch: int
    epochs: int
    cache_bytes: int
    sources: dict[str, SourcePlan] = field(default_factory=dict)
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def train_samples(cfg: PipelineConfig, data: Data) -> int:
    """The training split's samples (the rest is held out)."""
    return int(data.samples * (1 - cfg.data.val_fraction))


def _micro_samples(cfg: PipelineConfig, data: Data) -> list[tuple[int, int]]:
    return [(data.tokens_per_sample, data.loss_tokens_per_sample)] * cfg.train.micro_batch


def micro_batch_shape(c: DrafterConfig, samples: list[tuple[int, int]], num_anchors: int) -> tuple[int, int]:
    """(context positions, blocks) of a packed micro-batch of these samples."""
    from .batches import synthetic_micro_batch

    batch = synthetic_micro_batch(c, samples, num_anchors)
    return int(batch.context_hidden.shape[0]), batch.num_blocks


def step_memory(cfg: PipelineConfig, c: DrafterConfig, target: TargetShape, data: Data, cluster: Cluster,
                online: bool) -> Memory:
    """Per-rank peak memory of a training step of this config."""
    tc = cfg.train
    # 'auto' on a GPU cluster plans bf16; on CPU it is planned as this machine would resolve it.
    native_bf16 = cluster.device_type == "cuda" or cpu_has_fast_bf16()
    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and native_bf16)
    params = memory.parameter_counts(c)
    samples = _micro_samples(cfg, data)
    context, blocks = micro_batch_shape(c, samples, tc.num_anchors)
    half = 2 if bf16 else 4
    rank = c.markov_rank if c.markov_head_type != "none" else 0
    frozen = params.frozen * 4 + (c.vocab_size * (c.hidden_size + rank) * half if bf16 else 0)
    kept = 0  # host memory: the device's only on CPU, and only a cache is read (and kept)
    if cluster.device_type == "cpu" and not online:
        split_bytes = train_samples(cfg, data) * memory.sample_bytes(c, data.tokens_per_sample,
                                                                       data.loss_tokens_per_sample)
        kept = min(tc.cache_memory_mb * 2**20, split_bytes)
    online_target = 0
    if online:
        d = target.hidden_size
        T = data.tokens_per_sample * tc.micro_batch
        size = torch_dtype(auto_dtype(cfg.target.dtype, cluster.device_type)).itemsize  # weights + states
        online_target = (target.parameters * size + (target.num_layers + 1) * T * d * size
                         + 3 * T * target.intermediate_size * size)
    return Memory(
        states=params.trainable * 12, gradients=params.trainable * 4, frozen=frozen,
        activations=memory.traced_activation_bytes(c, samples, tc.num_anchors, tc.loss_chunk_blocks, bf16),
        transient=memory.loss_transient_bytes(c, blocks, tc.loss_chunk_blocks, bf16),
        batches=(1 + tc.prefetch_batches) * memory.batch_bytes(c, context, blocks),
        online_target=online_target, runtime=memory.RUNTIME_BYTES[cluster.device_type],
        ddp_buckets=params.trainable * 4 if cluster.gpus > 1 else 0,
        checkpoint=params.trainable * 8 if cluster.device_type == "cpu" else 0, kept=kept)


def step_flops(cfg: PipelineConfig, c: DrafterConfig, data: Data) -> StepFlops:
    """FLOPs of one micro-batch of the plan's samples."""
    context, blocks = micro_batch_shape(c, _micro_samples(cfg, data), cfg.train.num_anchors)
    return micro_batch_flops(c, context, blocks)


def target_forward_flops(target: TargetShape, tokens: int) -> float:
    """The target's forward over one sample (online training pays it every epoch)."""
    d, q = target.hidden_size, target.num_heads * target.head_dim
    layer = d * (q + 2 * target.num_kv_heads * target.head_dim) + q * d + 3 * d * target.intermediate_size
    return target.num_layers * (2 * tokens * layer + 2 * tokens * tokens * q)  # causal: half the scores


def make_plan(cfg: PipelineConfig, data: Data, cluster: Cluster) -> Plan:
    tc = cfg.train
    target, c = shapes(cfg)
    params = memory.parameter_counts(c)
    micro = step_flops(cfg, c, data)
    per_step = float(micro.total) * tc.global_batch / tc.micro_batch
    steps = max(1, train_samples(cfg, data) // tc.global_batch)
    layers = c.target_layer_ids
    tokens = data.samples * data.tokens_per_sample
    raw = layout_bytes(tokens, data.samples * data.loss_tokens_per_sample, len(layers), c.hidden_size,
                       cfg.cache.storage_dtype)
    plan = Plan(target=asdict(target) | {"parameters": target.parameters},
                drafter={"draft_layers": c.num_draft_layers, "block_size": c.block_size,
                         "num_anchors": tc.num_anchors, "layers": layers, "markov": c.markov_head_type,
                         "mask_token_id": c.mask_token_id, "micro_batch": tc.micro_batch,
                         "global_batch": tc.global_batch, "loss_chunk_blocks": tc.loss_chunk_blocks,
                         "precision": tc.precision},
                data=asdict(data), cluster=asdict(cluster),
                parameters={"trainable": params.trainable, "frozen": params.frozen},
                steps_per_epoch=steps, epochs=tc.epochs,
                cache_bytes=int(raw * EXPECTED_RATIO[(cfg.cache.storage_dtype, cfg.cache.compression)]))
    for source in ("cache", "online"):
        mem = step_memory(cfg, c, target, data, cluster, online=source == "online")
        flops = per_step + (target_forward_flops(target, data.tokens_per_sample) * tc.global_batch
                            if source == "online" else 0.0)
        epoch = flops * steps
        hours = epoch * tc.epochs / (cluster.gpus * cluster.tflops * 1e12) / 3600
        plan.sources[source] = SourcePlan(source, mem, mem.peak / GiB,
                                          mem.peak <= cluster.memory_gib * cluster.usable * GiB,
                                          flops, epoch, hours)
    plan.advice = advice(cfg, data, cluster, plan)
    return plan


def advice(cfg: PipelineConfig, data: Data, cluster: Cluster, plan: Plan) -> list[str]:
    """What to change, each alternative measured with the same model, when a source does not fit."""
    budget = cluster.memory_gib * cluster.usable
    lines = []
    for source, sp in plan.sources.items():
        if sp.fits:
            continue
        target, c = shapes(cfg)
        tried = []
        tc = cfg.train
        for key, value in (("num_anchors", tc.num_anchors // 2),
                           ("loss_chunk_blocks", max(8, tc.loss_chunk_blocks // 4)), ("prefetch_batches", 0)):
            if value == getattr(tc, key):
                continue
            trial = replace(cfg, train=replace(tc, **{key: value}))
            peak = step_memory(trial, c, target, data, cluster, online=source == "online").peak / GiB
            fits = " (fits)" if peak <= budget else ""
            tried.append(f"--set train.{key}={value} → {peak:.1f} GiB{fits}")
        if source == "online":
            tried.append(f"train from a cache instead → {plan.sources['cache'].peak_gib:.1f} GiB"
                         + (" (fits)" if plan.sources["cache"].fits else ""))
        lines.append(f"{source}: {sp.peak_gib:.1f} GiB per rank does not fit {budget:.0f} GiB "
                     f"({cluster.usable:.0%} of {cluster.memory_gib:g}); " + "; ".join(tried)
                     + ". More GPUs do not lower it: every DDP rank holds the whole drafter and its AdamW "
                     "states (micro batch is the floor at 1); GPUs with more memory do.")
    return lines


def plan_data(cfg: PipelineConfig, cache_url: str | None, samples: int | None, tokens: int | None,
              loss_tokens: int | None) -> Data:
    """The data size: flags first, else the finished cache's counts, else stated assumptions
    (Open-PerfectBlend's row count, 1024 tokens a sample, 3/4 of them the answer)."""
    from ..manifest import read_manifest

    found = read_manifest(cache_url) if cache_url else None
    if found and found.get("stage") == "cache" and (found.get("counts") or {}).get("samples"):
        counts = found["counts"]
        n = int(counts["samples"])
        measured = Data(n, int(counts["tokens"]) // n, int(counts["loss_tokens"]) // n, f"cache {cache_url}")
    else:
        measured = Data(OPEN_PERFECTBLEND_ROWS, 1024, 768, "assumed (no cache yet)")
    given = (samples, tokens, loss_tokens)
    if all(v is None for v in given):
        return measured
    return Data(samples or measured.samples, tokens or measured.tokens_per_sample,
                loss_tokens or measured.loss_tokens_per_sample, "flags" if None not in given else
                f"flags + {measured.origin}")
