"""Data preparation at scale: the tokenize-once cache against a plain apply_chat_template loop.

Writes N synthetic multi-turn conversations (default 20,000, about 1 KB each; `--large`:
200,000) as JSONL and measures, each in its own process and with the demo tokenizer,
`answer_only_loss: true` and `training_seq_len` 512:

- **baseline**: a plain single-process ``apply_chat_template(..., tokenize=True)`` loop over the
  same conversations (read with ``json``), the floor any data preparation pays once;
- **cold**: ``build_dataset`` with an empty cache (`data.num_proc` = the cores this process may
  use), then one pass over every example, as an epoch reads them;
- **warm**: the same with the cache of the cold run (a second start, a resume, another rank);
- **2 ranks cold**: the two ranks of a gloo process group started together on an empty cache,
  as torchrun starts them (rank 0 hashes the input and sends the hash; each rank tokenizes a
  slice with `data.num_proc / LOCAL_WORLD_SIZE` = 1 process, its own; rank 0 merges the
  slices), against one process cold (2 tokenizing processes);
- resident memory of cold and warm at 64 and at N conversations, each child a fresh
  interpreter reading its own ``/proc/self/status``: the peak (VmHWM) up to the first batch
  (``build_dataset``, the epoch's order, one batch: what a run pays before its first step),
  the anonymous and file-backed parts resident then, and the same after one pass over every
  example (an epoch's reads). Growth is the N figure minus the 64 one.

Preparation seconds are measured inside each process (from reading to the mapped examples,
imports and the tokenizer load excluded; the tokenizing processes' start-up is included);
ratios compare figures of this run only. Rounds are interleaved; figures are medians.

Usage: python benchmarks/bench_data.py [--conversations 20000] [--rounds 1] [--large]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _measure import REPO, WITH_BYTECODE_CACHE, Command, print_table, run_child

TOKENIZER = REPO / "dflash_recipes" / "demo_data" / "target"
SEQ_LEN = 512
_WORDS = tuple(
    [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "it",
        "as",
        "with",
        "was",
        "on",
        "be",
        "by",
        "this",
        "are",
        "from",
        "or",
        "an",
        "at",
        "which",
        "model",
        "data",
        "token",
        "answer",
        "question",
        "drafter",
        "target",
        "block",
        "layer",
        "training",
        "cache",
        "memory",
        "parquet",
        "arrow",
        "rank",
        "process",
        "conversation",
        "assistant",
        "user",
        "system",
        "speculative",
        "decoding",
    ]
)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def write_conversations(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(count):
            turns = []
            for _ in range(rng.randint(1, 3)):
                turns.append({"role": "user", "content": _text(rng, rng.randint(8, 40))})
                turns.append({"role": "assistant", "content": _text(rng, rng.randint(20, 90))})
            handle.write(json.dumps({"messages": turns}) + "\n")


# -- the measured processes --------------------------------------------------------------------


def _child_baseline(data: Path) -> dict[str, float]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    start = time.perf_counter()
    tokens = 0
    with data.open(encoding="utf-8") as handle:
        for line in handle:
            ids = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True)
            tokens += len(ids["input_ids"] if isinstance(ids, dict) else ids)
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def _child_prepare(data: Path, cache: Path, num_proc: int | None) -> dict[str, float]:
    from testkit.tiny import tiny_plan
    from transformers import AutoTokenizer

    from dflash_recipes.executor.data.train_dataset import batches, build_dataset

    env = None
    if "RANK" in os.environ:  # a rank of a gloo process group, as torchrun starts it
        from dflash_recipes.executor.dist_env import detect_dist_env, init_distributed

        env = detect_dist_env("cpu")
        init_distributed(env)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    plan = tiny_plan(
        cache.parent,
        data_path=str(data),
        training_seq_len=SEQ_LEN,
        block_size=8,
        cache_dir=str(cache),
        num_proc=num_proc,
    )
    start_rss = _rss_parts()
    start = time.perf_counter()
    dataset = build_dataset(plan, tokenizer, env=env)
    prepared = time.perf_counter() - start
    ready_at = time.time()
    # Up to the first step: the epoch's order and the first batch, as the trainer makes them.
    next(batches(dataset, batch_size=4, seed=0, epoch=0))
    prep_rss = _rss_parts()
    tokens = sum(len(example.input_ids) for example in dataset.examples)  # one epoch's reads
    epoch_rss = _rss_parts()
    if env is not None:
        from dflash_recipes.executor.dist_env import shutdown_distributed

        shutdown_distributed()
    return {
        "seconds": prepared,
        "ready_at": ready_at,
        "tokens": tokens,
        "examples": len(dataset),
        "imports_peak": start_rss["VmHWM"],
        **{f"prep_{k}": v for k, v in prep_rss.items()},
        **{f"epoch_{k}": v for k, v in epoch_rss.items()},
    }


def _rss_parts() -> dict[str, float]:
    """This process's resident memory, in MB: VmHWM (its peak since it started: the process
    is a fresh interpreter, so nothing of the parent counts), and what is resident now split
    into anonymous (its own heap) and file-backed (mapped files: libraries, and a memory-mapped
    cache's pages would count here)."""
    parts: dict[str, float] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "RssAnon", "RssFile"):
            parts[name] = int(value.split()[0]) / 1024
    return parts


# -- the driver --------------------------------------------------------------------------------


def _command(*args: str) -> Command:
    return Command([sys.executable, __file__, *args], env=WITH_BYTECODE_CACHE, capture=True)


#: What a prepare child reports, in the order the rows keep them: inner seconds, wall seconds,
#: then MB: peak RSS (VmHWM) up to the first batch, anonymous and file-backed RSS at that point,
#: anonymous and file-backed RSS after one epoch's reads, peak RSS after them.
Figures = tuple[float, ...]


def _measure(command: Command, fresh_cache: Path | None = None) -> Figures:
    """The figures of one child (see :data:`Figures`)."""
    if fresh_cache is not None:
        shutil.rmtree(fresh_cache, ignore_errors=True)
    sample = run_child(command, REPO)
    if sample.returncode != 0:
        msg = f"{' '.join(command.argv)} exited {sample.returncode}"
        raise SystemExit(msg)
    report = json.loads(sample.stdout.strip().splitlines()[-1])
    nan = float("nan")
    return (
        report["seconds"],
        sample.seconds,
        report.get("prep_VmHWM", sample.max_rss_kb / 1024),
        report.get("prep_RssAnon", nan),
        report.get("prep_RssFile", nan),
        report.get("epoch_RssAnon", nan),
        report.get("epoch_RssFile", nan),
        report.get("epoch_VmHWM", nan),
    )


def _two_ranks(data: Path, cache: Path) -> tuple[float, float]:
    """(wall seconds from the start of two processes started together until both have their
    data, the longer of their preparation seconds)."""
    shutil.rmtree(cache, ignore_errors=True)
    argv = [sys.executable, __file__, "--child", "prepare", str(data), str(cache)]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    group = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }
    start = time.time()
    procs = [
        subprocess.Popen(
            argv,
            cwd=REPO,
            env={**WITH_BYTECODE_CACHE, **group, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    reports = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit("a rank failed")
        reports.append(json.loads(out.decode().strip().splitlines()[-1]))
    ready = max(r["ready_at"] for r in reports) - start
    return ready, max(r["seconds"] for r in reports)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--large", action="store_true", help="200,000 conversations")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, data, *rest = args.child
        if kind == "baseline":
            report = _child_baseline(Path(data))
        else:
            num_proc = int(rest[1]) if len(rest) > 1 else None
            report = _child_prepare(Path(data), Path(rest[0]), num_proc)
        print(json.dumps(report))
        return
    count = 200_000 if args.large else args.conversations
    work = Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        big, small = work / "big.jsonl", work / "small.jsonl"
        write_conversations(big, count)
        write_conversations(small, 64)
        size_mb = big.stat().st_size / 2**20
        print(
            f"{count} conversations, {size_mb:.1f} MB of JSONL; demo tokenizer, seq_len {SEQ_LEN}"
        )
        cache, small_cache = work / "cache", work / "small-cache"
        figures: dict[str, list[Figures]] = {}

        def record(name: str, value: Figures) -> None:
            figures.setdefault(name, []).append(value)

        two_ranks: list[tuple[float, float]] = []
        one_rank: list[tuple[float, float]] = []
        for _ in range(args.rounds):
            record("baseline", _measure(_command("--child", "baseline", str(big))))
            record("cold", _measure(_command("--child", "prepare", str(big), str(cache)), cache))
            record("warm", _measure(_command("--child", "prepare", str(big), str(cache))))
            record(
                "cold, 1 process",
                _measure(_command("--child", "prepare", str(big), str(cache), "1"), cache),
            )
            small_cmd = _command("--child", "prepare", str(small), str(small_cache))
            record("cold, 64", _measure(small_cmd, small_cache))
            record("warm, 64", _measure(small_cmd))
            shutil.rmtree(cache, ignore_errors=True)
            start = time.time()
            sample = run_child(_command("--child", "prepare", str(big), str(cache)), REPO)
            report = json.loads(sample.stdout.strip().splitlines()[-1])
            one_rank.append((report["ready_at"] - start, report["seconds"]))
            two_ranks.append(_two_ranks(big, cache))

        def med(name: str, index: int) -> float:
            return statistics.median(v[index] for v in figures[name])

        base = med("baseline", 0)
        rows = [
            [
                name,
                f"{med(name, 0):.2f}",
                f"{med(name, 0) / base:.2f}x",
                f"{med(name, 1):.2f}",
                *(f"{med(name, i):.0f}" for i in range(2, 8)),
            ]
            for name in figures
        ]
        print_table(
            [
                "",
                "prep s",
                "vs baseline",
                "process s",
                "peak RSS MB",
                "anon MB",
                "file MB",
                "epoch anon MB",
                "epoch file MB",
                "epoch peak MB",
            ],
            rows,
        )
        print(
            "peak RSS: the process's VmHWM up to the first batch (build_dataset, the epoch's "
            "order, one batch); anon/file: resident then; epoch: after reading every example once"
        )
        warm_vs_cold = med("warm", 0) / med("cold", 0)
        print(f"second run / cold: {warm_vs_cold:.1%} of the cold preparation (target <= 10%)")
        print(
            f"cold / plain apply_chat_template loop: {med('cold', 0) / base:.2f}x (target <= 1.5x)"
        )
        for kind in ("cold", "warm"):

            def grown(index: int, kind: str = kind) -> float:
                return med(kind, index) - med(f"{kind}, 64", index)

            print(
                f"RSS growth 64 -> {count} conversations, {kind}: peak {grown(2):+.0f} MB up to "
                f"the first batch (resident then: anonymous {grown(3):+.0f} MB, file-backed "
                f"{grown(4):+.0f} MB); after one epoch's reads: anonymous {grown(5):+.0f} MB, "
                f"file-backed {grown(6):+.0f} MB, peak {grown(7):+.0f} MB (target <= 60 MB)"
            )
        for index, what in ((0, "process start to data ready"), (1, "data preparation")):
            two = statistics.median(v[index] for v in two_ranks)
            one = statistics.median(v[index] for v in one_rank)
            print(
                f"2 ranks vs 1 rank cold ({what}): {two:.2f} s vs {one:.2f} s, ratio "
                f"{two / one:.2f} (target <= 1.0: one build, a slice per rank)"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
