"""Whole-process measurements shared by the benchmark scripts (not a test, not the package).

Each child is started with Popen and reaped with os.wait4: wall time is perf_counter around
start and reap. Peak RSS comes from GNU time (`/usr/bin/time -f %M`) wrapping the child: a
child forked straight from this Python would report this process's RSS as its own peak
(Linux keeps the pre-exec high-water mark), so `ru_maxrss` of a direct child is not usable.
Commands are interleaved round by round after one discarded warm-up round, so a noisy
neighbour slows every command alike; figures are medians.

Bytecode: this environment sets PYTHONDONTWRITEBYTECODE=1, under which every process compiles
the package's modules from source again. An installed package has its .pyc files, so the
children get a bytecode cache in a temporary folder (PYTHONPYCACHEPREFIX, written during the
warm-up round, nothing written into the repository); :data:`NO_BYTECODE_CACHE` gives the
environment's own setting, for a row that shows the difference.

Importing this module also puts tests/ on sys.path, so a benchmark can use `testkit`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GNU_TIME = Path("/usr/bin/time")

# The benchmarks build their inputs with the test suite's fixture writers (tests/testkit). This
# is the one place that puts tests/ on the path for them, as pytest's `pythonpath` setting does
# for the tests: a benchmark imports this module before `testkit`.
TESTS = REPO / "tests"
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))

_PYCACHE = tempfile.mkdtemp(prefix="bench-pycache-")
atexit.register(shutil.rmtree, _PYCACHE, True)


def _environment(bytecode_cache: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE",)}
    if bytecode_cache:
        env["PYTHONPYCACHEPREFIX"] = _PYCACHE
    else:
        env.pop("PYTHONPYCACHEPREFIX", None)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


WITH_BYTECODE_CACHE = _environment(True)
NO_BYTECODE_CACHE = _environment(False)


@dataclass(frozen=True)
class Command:
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=lambda: WITH_BYTECODE_CACHE)
    #: Keep the child's stdout (a few lines at most: it is read after the child exits).
    capture: bool = False


@dataclass(frozen=True)
class Sample:
    seconds: float
    max_rss_kb: int
    returncode: int
    stdout: str = ""


def dflash_recipe_argv() -> list[str]:
    """The installed console script next to this interpreter (as a user runs it), else the
    same entry point through `python -c` (a shim such as pyenv's would time bash, not us)."""
    script = Path(sys.executable).parent / "dflash-recipe"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", "from dflash_recipes.cli import run_cli; run_cli()"]


def run_child(command: Command, cwd: Path) -> Sample:
    """Run the command to completion (output discarded); wall time, peak RSS, exit code."""
    with tempfile.NamedTemporaryFile("r", prefix="bench-rss-") as rss_file:
        argv = list(command.argv)
        if GNU_TIME.is_file():
            argv = [str(GNU_TIME), "-q", "-f", "%M", "-o", rss_file.name, *argv]
        start = time.perf_counter()
        child = subprocess.Popen(
            argv, cwd=cwd, env=dict(command.env), text=True,
            stdout=subprocess.PIPE if command.capture else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        stdout = child.stdout.read() if child.stdout is not None else ""
        if child.stdout is not None:
            child.stdout.close()
        text = rss_file.read().strip()
    max_rss_kb = int(text.splitlines()[-1]) if text else usage.ru_maxrss
    return Sample(seconds, max_rss_kb, child.returncode, stdout)


def interleaved(
    commands: Mapping[str, Command], cwd: Path, repeats: int, *, check: bool = True
) -> dict[str, list[Sample]]:
    """Run every command `repeats` times, round-robin, after one warm-up round."""
    samples: dict[str, list[Sample]] = {name: [] for name in commands}
    for round_number in range(repeats + 1):
        for name, command in commands.items():
            sample = run_child(command, cwd)
            if check and sample.returncode != 0:
                msg = f"{name} exited {sample.returncode}: {' '.join(command.argv)}"
                raise SystemExit(msg)
            if round_number > 0:
                samples[name].append(sample)
    return samples


def median_seconds(samples: Sequence[Sample]) -> float:
    return statistics.median(s.seconds for s in samples)


def median_rss_mb(samples: Sequence[Sample]) -> float:
    return statistics.median(s.max_rss_kb for s in samples) / 1024


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = f"{cells[0]:<{widths[0]}}"
        rest = [f"{cell:>{width}}" for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    print(line(header))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def fit_seconds_per_step(plan: Any, *, prefetch: bool) -> float:
    """Seconds per optimiser step of one fresh run of `plan` through `run`'s own ``setup`` and
    ``fit`` (setup not timed; `prefetch` False: batches prepared on the loop's thread)."""
    from dflash_recipes.executor.dist_env import detect_dist_env
    from dflash_recipes.executor.signals import SignalWatch
    from dflash_recipes.executor.training.fit import fit, setup

    env = detect_dist_env(plan.training.device, {})
    run = setup(plan, env, None, verify_capture=False)
    try:
        started = time.perf_counter()
        progress = fit(run, SignalWatch(), None, show_progress=False, prefetch=prefetch)
        seconds = time.perf_counter() - started
    finally:
        run.trackers.close("finished")
        run.data.close()
    steps = progress.done - run.start.step
    assert steps > 0 and progress.done == run.optimization.total_steps
    return seconds / steps


def write_wide_target(
    folder: Path, hidden: int, layers: int, *, intermediate: int = 0, experts: int = 0
) -> Path:
    """A random Qwen3 target of `hidden` and `layers` (intermediate ``4 * hidden`` unless
    given; heads of 64), float32, saved to `folder` with the demo target's tokenizer: a target
    wider and deeper than the demo's, for the benchmarks that need its cost to show. With
    `experts`, a Qwen3-MoE target instead: every layer's MLP is `experts` experts of
    `intermediate` (``2 * hidden`` unless given), 2 per token, stored expert by expert."""
    import torch
    from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

    shape = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 256),
        "head_dim": 64,
        "vocab_size": 392,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "eos_token_id": 2,
    }
    torch.manual_seed(0)
    model: PreTrainedModel
    if experts:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        moe = Qwen3MoeConfig(
            **shape,
            intermediate_size=4 * hidden,
            moe_intermediate_size=intermediate or 2 * hidden,
            num_experts=experts,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        model = Qwen3MoeForCausalLM(moe)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, intermediate_size=intermediate or 4 * hidden))
    model.save_pretrained(folder)
    demo = REPO / "dflash_recipes" / "demo_data" / "target"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(demo / name, folder / name)
    return folder
