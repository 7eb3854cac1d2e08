"""Warm-start load of a ~200 MB drafter vs ``safetensors.torch.load_file`` of the same file.

Prints, measured in one run (machines here are noisy, so only ratios are meaningful):

- time: median over interleaved repeats of the warm-start loader (streaming into a freshly
  built float32 module, as ``convert`` does) and of ``load_file``; target ratio <= 1.5x;
- peak extra RSS of each, relative to the file size, each in its own subprocess (peak reset
  after the module is built, so the module's own memory is not counted); target <= 1.2x.

safetensors >= 0.6 makes ``load_file`` lazy on CPU (tensors backed by an mmap of the file), so
``load_file`` alone reads no tensor bytes. The comparable baselines are therefore also printed:
``load_file`` followed by ``module.load_state_dict`` (the same work as the warm start: every
byte read and copied into the module) and ``load_file`` with every tensor materialised
(``clone``), which is what an eager loader costs.

Usage: ``python benchmarks/bench_warmstart.py [--repeats 5] [--dtype bfloat16|float32]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _measure  # noqa: F401 (puts tests/ on sys.path for testkit)
import torch
from safetensors.torch import load_file
from testkit.tiny import tiny_plan, with_init_checkpoint

from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.executor.model.warmstart import load_init_checkpoint
from dflash_recipes.plan.run_plan import RunPlan

# About 109 M parameters: 218 MB in bf16.
DIMS: dict[str, object] = {
    "target_hidden_size": 2048,
    "target_vocab_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "target_layer_ids": (0, 1, 2),
    "mask_token_id": 1000,
}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    msg = f"{field} not in /proc/self/status"
    raise RuntimeError(msg)


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux clear_refs 5); return the baseline in kB."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return _status_kb("VmHWM")  # cannot reset: the peak so far is the baseline
    return _status_kb("VmRSS")


def _plan(workdir: Path) -> RunPlan:
    return with_init_checkpoint(tiny_plan(workdir, **DIMS), workdir / "init")


KINDS = ("warmstart", "load_file", "load_file+load_state_dict", "load_file+clone")


def run_once(kind: str, module: DFlashDraftModel, plan: RunPlan, weights: Path) -> None:
    """One load of ``kind``; the tensors it returns are dropped when it returns."""
    if kind == "warmstart":
        load_init_checkpoint(module, plan)
    elif kind == "load_file":
        tensors = load_file(str(weights))
        assert tensors
    elif kind == "load_file+load_state_dict":
        module.load_state_dict(load_file(str(weights)))
    else:
        tensors = {name: t.clone() for name, t in load_file(str(weights)).items()}
        assert tensors


def child(kind: str, workdir: Path) -> None:
    """Measure one loader's peak extra RSS in this fresh process; print JSON."""
    plan = _plan(workdir)
    module = DFlashDraftModel(plan.resolved_draft())
    baseline = _reset_peak()
    run_once(kind, module, plan, workdir / "init" / "model.safetensors")
    print(json.dumps({"extra_kb": _status_kb("VmHWM") - baseline}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--child", choices=KINDS)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.workdir)
        return

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        plain = tiny_plan(workdir, **DIMS)
        source = DFlashDraftModel(plain.resolved_draft())
        export_drafter(source, plain, workdir / "init", dtype=args.dtype)
        del source
        weights = workdir / "init" / "model.safetensors"
        size = weights.stat().st_size
        plan = _plan(workdir)
        module = DFlashDraftModel(plan.resolved_draft())
        taps = len(plan.draft.target_layer_ids or ())
        print(f"checkpoint: {size / 1e6:.0f} MB {args.dtype}, {taps} taps; module float32")

        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for repeat in range(args.repeats):
            order = KINDS if repeat % 2 == 0 else tuple(reversed(KINDS))
            for kind in order:
                start = time.perf_counter()
                run_once(kind, module, plan, weights)
                times[kind].append(time.perf_counter() - start)
        median = {kind: statistics.median(values) for kind, values in times.items()}
        ours = median["warmstart"]
        print(f"time, median of {args.repeats} interleaved repeats:")
        for kind in KINDS:
            ratio = (
                "" if kind == "warmstart" else f"   warm start / this = {ours / median[kind]:.2f}x"
            )
            print(f"  {kind:<27} {median[kind] * 1e3:8.1f} ms{ratio}")

        print("peak extra RSS (own subprocess each), relative to the file size:")
        for kind in KINDS:
            result = subprocess.run(
                [sys.executable, __file__, "--child", kind, "--workdir", str(workdir)],
                check=True,
                capture_output=True,
                text=True,
            )
            extra = json.loads(result.stdout.strip().splitlines()[-1])["extra_kb"] * 1024
            print(f"  {kind:<27} {extra / 1e6:8.0f} MB = {extra / size:.2f}x")
        print("targets: warm start time <= 1.5x the load_file baseline; peak extra RSS <= 1.2x")


if __name__ == "__main__":
    main()
