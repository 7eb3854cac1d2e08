"""Compile against a Qwen3-8B-scale warm start (2.1 GB drafter) vs loading its weights.

The fixture is benchmarks/make_8b_fixture.py's: Qwen3-8B's config.json, and a sparse
model.safetensors with the 58-tensor BF16 layout of Qwen3-8B-DFlash-b16 (2.1 GB, almost
nothing on disk). Measured in one run, interleaved (machines here are noisy; read ratios):

- whole-process `dflash-recipe compile` of the fine-tuning recipe: time (target < 0.3 s) and
  peak RSS (target < 80 MB): compile reads config.json files and the safetensors header only;
- `safetensors.torch.load_file` of the same file plus touching every tensor (a float32 sum of
  each, so every byte is really read), in a child process: its in-process time (torch import
  excluded, which favours the baseline) and the whole process; target: compile >= 10x faster;
- plain `load_file` too (lazy on CPU in safetensors >= 0.6: it maps the file, reads no data).

Usage: python benchmarks/bench_compile_8b.py [--repeats 10] [--load-repeats 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _measure import (
    Command,
    dflash_recipe_argv,
    interleaved,
    median_rss_mb,
    median_seconds,
    print_table,
    verdict,
)
from testkit.fixture_8b import make_fixture

TARGET_SECONDS = 0.3
TARGET_RSS_MB = 80.0
TARGET_RATIO = 10.0
COMPILE = "dflash-recipe compile recipe.yaml -o plan.json"
TOUCH = "load_file + touch every tensor (whole process)"
LAZY = "load_file (whole process)"

# Prints its own timings as JSON: import, load_file, touching every tensor.
LOAD_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
import torch
from safetensors.torch import load_file
t1 = time.perf_counter()
tensors = load_file(sys.argv[1])
t2 = time.perf_counter()
touch = sys.argv[2] == "touch"
total = 0.0
if touch:
    for tensor in tensors.values():
        total += float(tensor.sum(dtype=torch.float32))
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "touch": t3 - t2, "n": len(tensors)}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=10, help="compile runs")
    parser.add_argument("--load-repeats", type=int, default=3, help="load_file+touch runs")
    parser.add_argument("--keep", type=Path, help="write the fixture here and keep it")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-8b-") as tmp:
        out = args.keep or Path(tmp)
        for line in make_fixture(out):
            print(line)
        weights = out / "drafter" / "model.safetensors"
        cli = dflash_recipe_argv()
        load = [sys.executable, "-c", LOAD_SCRIPT, str(weights)]
        commands = {
            "python -c pass": Command([sys.executable, "-c", "pass"]),
            COMPILE: Command([*cli, "compile", "recipe.yaml", "-o", "plan.json"]),
        }
        loads = {
            TOUCH: Command([*load, "touch"], capture=True),
            LAZY: Command([*load, "lazy"], capture=True),
        }
        # the loads take seconds each: fewer rounds of them, in between two compile series
        samples = interleaved(commands, out, args.repeats)
        samples.update(interleaved(loads, out, args.load_repeats))
        for name, runs in interleaved(commands, out, args.repeats).items():
            samples[name] += runs
        plan = json.loads((out / "plan.json").read_text(encoding="utf-8"))

    inside = {name: [json.loads(s.stdout) for s in samples[name]] for name in loads}
    compile_s = median_seconds(samples[COMPILE])
    compile_rss = median_rss_mb(samples[COMPILE])
    touch_in = statistics.median(r["load"] + r["touch"] for r in inside[TOUCH])
    lazy_in = statistics.median(r["load"] for r in inside[LAZY])
    torch_import = statistics.median(r["import"] for r in inside[TOUCH] + inside[LAZY])
    touch_whole = median_seconds(samples[TOUCH])

    print()
    checkpoint = plan["init_checkpoint"]
    print(
        f"plan: {checkpoint['tensor_count']} tensors {checkpoint['dtypes']}, taps "
        f"{plan['draft']['target_layer_ids']}, mask {plan['draft']['mask_token_id']}"
    )
    rows = [
        [name, f"{median_seconds(runs):.3f}", f"{median_rss_mb(runs):.1f}", str(len(runs))]
        for name, runs in samples.items()
    ]
    load_runs = str(args.load_repeats)
    rows += [
        ["load_file + touch, in process (no torch import)", f"{touch_in:.3f}", "", load_runs],
        ["load_file, in process (no torch import)", f"{lazy_in:.3f}", "", load_runs],
        ["import torch + safetensors, in process", f"{torch_import:.3f}", "", load_runs],
    ]
    print_table(["measurement", "median s", "peak RSS MB", "runs"], rows)
    print()
    ratio_in, ratio_whole = touch_in / compile_s, touch_whole / compile_s
    print(
        f"compile: {compile_s:.3f} s (target < {TARGET_SECONDS} s: "
        f"{verdict(compile_s < TARGET_SECONDS)}), peak RSS {compile_rss:.1f} MB "
        f"(target < {TARGET_RSS_MB:.0f} MB: {verdict(compile_rss < TARGET_RSS_MB)})"
    )
    print(
        f"compile (whole process) is {ratio_in:.1f}x faster than load_file + touch in process "
        f"(target >= {TARGET_RATIO:.0f}x: {verdict(ratio_in >= TARGET_RATIO)}), "
        f"{ratio_whole:.1f}x whole process against whole process; lazy load_file alone, "
        f"which reads no tensor data, takes {lazy_in / compile_s:.2f}x the compile time"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
