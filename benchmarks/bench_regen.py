"""Regen client throughput against the fixture server with a fixed reply delay.

    .venv/bin/python -m benchmarks.bench_regen --prompts 3200 --delay 0.2 --concurrency 64

With a 200 ms reply and 64 requests in flight the ideal is 64 / 0.2 = 320 requests/s; the client
(and the storage writes it makes) should reach at least 85 % of that. Prints one line per figure
and, with --json, a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fixtures.openai_server import start_openai_server  # noqa: E402

from dspark_cli.config import load_config  # noqa: E402
from dspark_cli.data.prepare import prepare  # noqa: E402
from dspark_cli.data.regen import regen  # noqa: E402


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _bare_client(url: str, n: int, concurrency: int) -> float:
    """Requests/s of a bare aiohttp loop (no SDK, no storage) against the same server: the ceiling
    this machine allows right now, to read the regen figure against."""
    import asyncio

    import aiohttp

    left = iter(range(n))
    async with aiohttp.ClientSession() as session:
        async def worker() -> None:
            for i in left:
                body = {"model": "bench-model", "messages": [{"role": "user", "content": f"bare {i}"}]}
                async with session.post(f"{url}/chat/completions", json=body) as resp:
                    await resp.json()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3200)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-rows", type=int, default=256)
    parser.add_argument("--server-workers", type=int, default=1,
                        help="fixture server processes (1 is enough when the machine is idle)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-regen-") as tmp, \
            start_openai_server(model="bench-model", faults={"delay": args.delay},
                                workers=args.server_workers) as server:
        src = Path(tmp) / "prompts.jsonl"
        with src.open("w") as f:
            for i in range(args.prompts):
                f.write(json.dumps({"id": f"p{i}", "messages": [
                    {"role": "user", "content": f"Question {i}: what is {i} plus {i * 7}?"}]}) + "\n")
        cfg = load_config(None, [f"data.source={src}", f"regen.endpoints=['{server.url}']",
                                 "regen.model=bench-model", f"regen.concurrency={args.concurrency}",
                                 f"regen.batch_rows={args.batch_rows}"])
        prepare(cfg, f"{tmp}/prompts")
        server_cpu = _cpu_seconds(server.proc.pid)
        start, cpu = time.perf_counter(), time.process_time()
        result = regen(cfg, f"{tmp}/prompts", f"{tmp}/responses", show_progress=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        server_cpu = _cpu_seconds(server.proc.pid) - server_cpu
        import asyncio

        bare = asyncio.run(_bare_client(server.url, args.prompts, args.concurrency))

    ideal = args.concurrency / args.delay
    manifest_rate = result.counts["requests_this_run"] / wall
    summary = {
        "prompts": args.prompts, "delay_s": args.delay, "concurrency": args.concurrency,
        "responses": result.counts["responses"],
        "wall_s": round(wall, 3), "requests_per_s": round(manifest_rate, 1),
        "ideal_requests_per_s": round(ideal, 1), "fraction_of_ideal": round(manifest_rate / ideal, 3),
        "client_cpu_ms_per_request": round(1000 * cpu / result.counts["requests_this_run"], 3),
        "server_cpu_ms_per_request": round(1000 * server_cpu / result.counts["requests_this_run"], 3),
        "load_average_before": round(load_before, 2), "cpus": os.cpu_count(),
        "bare_aiohttp_requests_per_s": round(bare, 1), "bare_fraction_of_ideal": round(bare / ideal, 3),
    }
    print(f"regen: {summary['responses']} responses in {summary['wall_s']} s "
          f"(end to end: probe, reads, requests, shard writes, manifest)")
    print(f"achieved {summary['requests_per_s']} req/s of an ideal {summary['ideal_requests_per_s']} "
          f"(delay {args.delay}s x concurrency {args.concurrency}) -> "
          f"{summary['fraction_of_ideal']:.3f} of ideal (goal >= 0.85)")
    print(f"CPU per request: client {summary['client_cpu_ms_per_request']} ms, fixture server (main process) "
          f"{summary['server_cpu_ms_per_request']} ms; load average before the run "
          f"{summary['load_average_before']} on {summary['cpus']} CPUs (other work competes for them)")
    print(f"same server, bare aiohttp loop (no SDK, no storage): {summary['bare_aiohttp_requests_per_s']} "
          f"req/s -> {summary['bare_fraction_of_ideal']:.3f} of ideal (the machine's ceiling right now)")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
