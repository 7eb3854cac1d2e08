"""`dflash-recipe regenerate` throughput against a server with a fixed per-request latency.

Starts tools/openai_test_server.py with canned answers (no model: the server's own cost is
nearly zero) and a fixed latency per request (default 50 ms), then runs the whole regenerate
path in this process (input reading, the httpx client, the journal and shards, the final
assembly) at max_concurrency 1, 8 and 32, each on its own fresh output. Throughput is
conversations per second; the ratio to max_concurrency 1 is what concurrency buys (ideal: the
concurrency itself; target >= 6x at 8). The client's own overhead per request is measured at
latency 0 and concurrency 1 (an upper bound: it includes the local server's handling and the
loopback round trip), as this process's CPU time per request (the client alone: the server
is another process), and as (time per request at concurrency 1) - latency.

Usage: python benchmarks/bench_regenerate.py [--latency-ms 50] [--requests 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "dflash_recipes" / "demo_data" / "target"


def _start_server(latency_ms: float) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tools" / "openai_test_server.py"),
            "--canned",
            "a canned answer of about ten words for the benchmark run",
            "--latency-ms",
            str(latency_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        msg = f"the test server did not start: {line!r}"
        raise SystemExit(msg)
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


def _write_prompts(path: Path, count: int) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for i in range(count):
            row = {"messages": [{"role": "user", "content": f"question number {i}?"}]}
            handle.write(json.dumps(row) + "\n")


def _run(work: Path, url: str, concurrency: int, count: int, tag: str) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one whole regenerate of `count` prompts."""
    from dflash_recipes.compiler.compilation import compile_file
    from dflash_recipes.executor.regenerate.job import run_regenerate

    prompts = work / f"{tag}.prompts.jsonl"
    _write_prompts(prompts, count)
    recipe = work / f"{tag}.yaml"
    recipe.write_text(
        f"model: {{model_name_or_path: {TARGET}, dtype: float32}}\n"
        f"data: {{data_path: {prompts}}}\n"
        "training: {training_seq_len: 128, device: cpu}\n"
        "dflash:\n  dflash_mask_token_id: 384\n  dflash_architecture_config: "
        "{num_hidden_layers: 1, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 32, "
        "intermediate_size: 128}\n"
        f"regenerate: {{base_url: {url}/v1, model: tiny-target, max_new_tokens: 64, "
        f"max_concurrency: {concurrency}}}\n",
        encoding="utf-8",
    )
    result = compile_file(recipe)
    assert result.plan is not None, result.diagnostics
    started, cpu = time.perf_counter(), time.process_time()
    summary = run_regenerate(
        result.plan, output_path=work / f"{tag}.out.jsonl", progress=False, echo=lambda _: None
    )
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert summary.answered == count and summary.failed == 0, summary.text()
    return seconds, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--requests", type=int, default=64, help="requests at concurrency 1")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    proc, url = _start_server(args.latency_ms)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-regenerate-") as tmp:
            work = Path(tmp)
            _run(work, url, 4, 16, "warmup")
            rows = []
            for concurrency in (1, 8, 32):
                count = args.requests * min(concurrency, 8)  # enough to keep 32 in flight
                seconds, cpu = _run(work, url, concurrency, count, f"c{concurrency}")
                rows.append((concurrency, count, seconds, count / seconds, cpu / count))
            httpx.post(f"{url}/control", json={"latency_ms": 0}).raise_for_status()
            zero_count = args.requests * 4
            zero, zero_cpu = _run(work, url, 1, zero_count, "zero")
            httpx.post(f"{url}/control", json={"latency_ms": args.latency_ms})
    finally:
        proc.kill()
        proc.wait()
    base = rows[0][3]
    print(f"regenerate against a server with {args.latency_ms:g} ms per request (canned answers)")
    print(
        f"{'max_concurrency':>16s} {'requests':>9s} {'seconds':>8s} {'req/s':>8s} {'x c=1':>7s} "
        f"{'client CPU ms/req':>18s}"
    )
    for concurrency, count, seconds, rate, cpu in rows:
        print(
            f"{concurrency:16d} {count:9d} {seconds:8.2f} {rate:8.1f} {rate / base:7.2f} "
            f"{cpu * 1000:18.2f}"
        )
    per_request = rows[0][2] / rows[0][1]
    print(
        f"client overhead per request: {zero_cpu / zero_count * 1000:.2f} ms of client CPU and "
        f"{zero / zero_count * 1000:.2f} ms wall (client + local server) at latency 0, c=1; "
        f"{per_request * 1000 - args.latency_ms:.2f} ms wall over the {args.latency_ms:g} ms "
        "latency at c=1"
    )
    ratio8 = rows[1][3] / base
    verdict = "meets" if ratio8 >= 6 else "MISSES"
    print(f"throughput at max_concurrency 8 is {ratio8:.2f}x c=1: {verdict} the >= 6x target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
