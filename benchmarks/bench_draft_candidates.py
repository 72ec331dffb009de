"""Which candidates the top-k draft keeps (docs/eval.md, "The draft distribution is top-k"): τ of
the demo drafter decoding GSM8K + HumanEval at T = 1 with

- `base`: the k best base logits alone (the drafter before 2026-12-03),
- `base+markov`: those and the k tokens the vanilla Markov bias favours after the previous token
  (the default),
- `all`: the whole vocabulary (`--draft-top-k 0`), what the engines compute,

each over the same conversations and seeds, with the head loop's milliseconds a round. One line per
mode for scripts:

    bench-draft-candidates mode=base+markov tau=1.563 rounds=1791 heads_ms=2.9

Decoding only (no target-only baseline), so τ is the figure; timings are whatever the machine runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from dspark_cli.decode.prompts import load_conversations
from dspark_cli.decode.scheduler import Scheduler
from dspark_cli.decode.specdec import SpeculativeDecoder
from dspark_cli.model.export import load_drafter
from dspark_cli.target.model import load_target

DATASETS = ["dspark_cli/resources/demo_eval_gsm8k.jsonl", "dspark_cli/resources/demo_eval_humaneval.jsonl"]
MODES = {"base": (64, False), "base+markov": (64, True), "all": (0, True)}


class _Candidates:
    """The drafter with `markov_candidates` fixed: SpeculativeDecoder calls draft() as usual."""

    def __init__(self, drafter, markov_candidates: bool) -> None:
        self._drafter, self._markov = drafter, markov_candidates

    def __getattr__(self, name):
        return getattr(self._drafter, name)

    def draft(self, *args, **kwargs):
        return self._drafter.draft(*args, **kwargs, markov_candidates=self._markov)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="runs/models/smollm2-135m-instruct")
    ap.add_argument("--drafter", default="runs/smollm2-135m-dspark/train")
    ap.add_argument("--limit", type=int, default=8, help="conversations per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.target, dtype="bfloat16", device="cpu")
    drafter = load_drafter(args.drafter, target=args.target, dtype=torch.bfloat16)
    convs = [c for url in DATASETS for c in load_conversations(url, args.limit)]
    print(f"# bench-draft-candidates: {args.drafter}, {len(convs)} conversations × ≤ {args.max_new_tokens} "
          f"tokens, T = 1, seeds {args.seeds}", flush=True)
    for mode in args.modes.split(","):
        top_k, markov = MODES[mode]
        accepted = rounds = 0
        heads = 0.0
        t0 = time.perf_counter()
        for seed in (int(s) for s in args.seeds.split(",")):
            decoder = SpeculativeDecoder(model, tokenizer, _Candidates(drafter, markov),
                                         Scheduler("fixed", drafter.block_size), temperature=1.0,
                                         max_new_tokens=args.max_new_tokens, seed=seed, draft_top_k=top_k)
            stats = decoder.run(convs, 1)
            accepted += sum(r.accepted for r in stats.rounds)
            rounds += len(stats.rounds)
            heads += stats.phases.get("draft_heads", 0.0)
        print(f"bench-draft-candidates mode={mode} tau={(accepted + rounds) / rounds:.3f} rounds={rounds} "
              f"heads_ms={1000 * heads / rounds:.1f} wall_s={time.perf_counter() - t0:.0f}", flush=True)


if __name__ == "__main__":
    main()
