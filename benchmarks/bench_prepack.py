"""Prepacked target linears (target/prepack.py) against the plain ones, same process, same target.

    make bench-prepack
    python -m benchmarks.bench_prepack --context 300 --repeats 9

For each path it times, with the decoder's own batched forward (`profile_target`, the call
`dspark eval` verifies with), one verification step of B = 1, 2, 4, 8 tokens over a cached
context; one server decode step of 32 sequences of one token (`dspark serve` during regen); and a
cache-build prefill of 8 × 512 tokens. Then one line per figure for scripts:

    bench-prepack verify B=8 plain_ms=148.0 packed_ms=96.4 speedup=1.54

Timings are wall-clock: run it on an idle machine (the header prints the load average).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark_cli.decode.sps import profile_target
from dspark_cli.target.dtypes import auto_dtype
from dspark_cli.target.model import load_target
from dspark_cli.target.prepack import packed_count, prepack_linears

VERIFY_TOKENS = [1, 2, 4, 8]


def step_ms(model: torch.nn.Module, tokens: int, context: int, repeats: int, tokens_per_row: int) -> float:
    table = profile_target(model, [tokens], context_length=context, repeats=repeats,
                           tokens_per_row=tokens_per_row)
    return 1000.0 / table.steps_per_second[0]


def prefill_s(model: torch.nn.Module, rows: int, length: int, repeats: int) -> float:
    ids = torch.randint(100, 1000, (rows, length), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            model(ids, output_hidden_states=True)
            if i:  # the first call pays one-off allocations
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, float]:
    out = {f"verify B={b}": step_ms(model, b, args.context, args.repeats, 8) for b in VERIFY_TOKENS}
    out["server step R=32"] = step_ms(model, 32, args.context, max(3, args.repeats // 2), 1)
    out["prefill 8x512"] = 1000.0 * prefill_s(model, 8, 512, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="runs/models/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300, help="cached tokens before the verified ones")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = auto_dtype(args.dtype, "cpu")
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"# bench-prepack {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}: {args.target}, {dtype}, "
          f"{args.threads} threads, context {args.context}; load average {load}")
    model, _ = load_target(args.target, dtype=dtype, device="cpu")
    plain = measure(model, args)
    if not prepack_linears(model):
        print("# nothing packed here (not CPU float32 or native bf16, no oneDNN, or not enough memory): "
              "plain only")
        for name, ms in plain.items():
            print(f"| {name} | {ms:.1f} ms |")
        return
    packed = measure(model, args)
    print(f"\n{packed_count(model)} linears packed\n")
    print("| step | plain ms | packed ms | speed-up |\n|---|---|---|---|")
    for name in plain:
        print(f"| {name} | {plain[name]:.1f} | {packed[name]:.1f} | {plain[name] / packed[name]:.2f}× |")
    ratio = {path: t["verify B=8"] / t["verify B=1"] for path, t in (("plain", plain), ("packed", packed))}
    print(f"\nverifying 8 tokens costs {ratio['plain']:.2f} one-token steps plain, "
          f"{ratio['packed']:.2f} packed (each against its own one-token step)\n")
    for name in plain:
        what, _, size = name.rpartition(" ")
        print(f"bench-prepack {what.replace(' ', '_')} {size} plain_ms={plain[name]:.1f} "
              f"packed_ms={packed[name]:.1f} speedup={plain[name] / packed[name]:.2f}")


if __name__ == "__main__":
    main()
