"""FlopCounterMode's count of one real optimizer step of `dspark train` from a cache: the trainer's
own step plan, batch maker, drafter, frozen weights, loss and precision, forward and backward of
every micro-batch of the step (AdamW's elementwise update is no matmul: neither the counter nor
the plan counts it). CPU's fused attention is counted too (plan.flops.flop_counter).

    python -m benchmarks.step_flops --config pipelines/qwen3-4b.toml --cache runs/rehearse/cache \
        --set train.global_batch=4 ...          # prints one JSON line

Prints the count and the step's samples' mean sizes, so `dspark plan --tokens-per-sample …` can
predict the same step.
"""

from __future__ import annotations

import argparse
import json

import torch


def count_step(config: str, sets: list[str], cache: str, step: int = 0) -> dict:
    from dspark_cli.cache.reader import CacheDataset
    from dspark_cli.commands._common import load
    from dspark_cli.model.attention import dense_mask
    from dspark_cli.model.drafter import DSparkDrafter
    from dspark_cli.model.frozen import attach_frozen
    from dspark_cli.plan.flops import flop_counter
    from dspark_cli.train.data import BatchMaker, StepPlan, plan_items
    from dspark_cli.train.loss import DrafterLoss, LossWeights
    from dspark_cli.train.trainer import autocast_for, drafter_config_for

    cfg = load(config, sets)
    tc = cfg.train
    dataset = CacheDataset(cache, split="train")
    dcfg = drafter_config_for(cfg, dict(dataset.meta))
    plan = StepPlan(len(dataset), tc.global_batch, tc.micro_batch, 1, 0, tc.seed)
    torch.manual_seed(tc.seed)
    drafter = DSparkDrafter(dcfg)
    attach_frozen(drafter, dcfg.target_model)
    weights = LossWeights(tc.ce_weight, tc.tv_weight, tc.conf_weight, tc.gamma_decay)
    # The plan counts the step without train.fast_kernels (whose row de-duplication has
    # data-dependent shapes), so the check counts that same step; the fast path does fewer FLOPs.
    loss_module = DrafterLoss(drafter, weights, tc.loss_chunk_blocks,
                              detach_confidence_inputs=tc.detach_confidence_inputs, fast_kernels=False)
    maker = BatchMaker(dataset, plan, tc.num_anchors, tc.seed, dcfg)
    device = torch.device("cpu")
    items = list(plan_items(plan, step, step + 1))
    indices = [i for _, _, mb in items for i in mb]
    sizes = [(int(dataset[i].input_ids.numel()), int(dataset[i].loss_mask.sum())) for i in indices]
    with flop_counter() as counter:
        for item in items:
            batch = maker(item).batch
            with autocast_for(tc.precision, device):
                loss, _ = loss_module(batch, dense_mask(batch.layout))
            (loss / plan.accumulation).backward()
    n = len(sizes)
    return {"flops_counted": counter.get_total_flops(), "samples": n,
            "tokens_per_sample": sum(t for t, _ in sizes) / n,
            "loss_tokens_per_sample": sum(m for _, m in sizes) / n, "sizes": sizes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(count_step(args.config, args.sets, args.cache, args.step)))


if __name__ == "__main__":
    main()
