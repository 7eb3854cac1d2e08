"""Whole-process `dflash-recipe compile` of a tiny warm-start recipe (target < 0.3 s).

Baselines measured in the same run, interleaved: `python -c pass` (interpreter start) and
`python -c "import click, attrs, cattrs, yaml"` (the compile path's dependencies as issue 15
names them, the baseline of its target), and `dflash-recipe --version` (our CLI start,
no compile). Machines here are noisy: read the ratios first.

Recipes are no longer structured through cattrs (plans still are), so compile itself imports
only click, attrs and yaml; the ratio against importing just those three is printed too, so
that the gain from leaving cattrs out is not mistaken for a gain in the project's own code.

Last, `python -X importtime` of the same compile, repeated: the median time each project module
spends on its own at import (issue 15's bound: none over 5 ms), the five largest printed.

The last row runs compile without a bytecode cache (PYTHONDONTWRITEBYTECODE=1, as this
environment is set up): every module of the package is compiled from source again.

Usage: python benchmarks/bench_compile.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _measure import (
    NO_BYTECODE_CACHE,
    WITH_BYTECODE_CACHE,
    Command,
    dflash_recipe_argv,
    interleaved,
    median_rss_mb,
    median_seconds,
    print_table,
    verdict,
)
from testkit.st_fixtures import write_base_model, write_drafter_checkpoint

TARGET_SECONDS = 0.3
#: No project module may spend more than this of its own at import (issue 15).
MODULE_SELF_MS = 5.0
#: Compile, whole process, over importing its dependencies alone (issue 15).
TARGET_RATIO = 1.3
PASS = "python -c pass"
IMPORTS = "python -c 'import click, attrs, cattrs, yaml'"
IMPORTS_USED = "python -c 'import click, attrs, yaml'"
COMPILE = "dflash-recipe compile recipe.yaml -o plan.json"

RECIPE = """\
# dflash-recipe compile recipe.yaml -o plan.json
model:
  model_name_or_path: base
data:
  data_path: train.jsonl
training:
  output_dir: run
  learning_rate: 1.0e-4
dflash:
  dflash_init_checkpoint: drafter
  dflash_block_size: 16
  dflash_mask_token_id: 250
  dflash_architecture_config:
    num_hidden_layers: 2
    num_attention_heads: 4
    num_key_value_heads: 2
    head_dim: 8
    intermediate_size: 64
    target_layer_ids: [1, 5]
"""


def write_tiny(workdir: Path) -> None:
    write_base_model(workdir / "base")
    write_drafter_checkpoint(workdir / "drafter")
    (workdir / "train.jsonl").write_text('{"messages": []}\n', encoding="utf-8")
    (workdir / "recipe.yaml").write_text(RECIPE, encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    cli = dflash_recipe_argv()
    compile_argv = [*cli, "compile", "recipe.yaml", "-o", "plan.json"]
    commands = {
        PASS: Command([sys.executable, "-c", "pass"]),
        IMPORTS: Command([sys.executable, "-c", "import click, attrs, cattrs, yaml"]),
        IMPORTS_USED: Command([sys.executable, "-c", "import click, attrs, yaml"]),
        "dflash-recipe --version": Command([*cli, "--version"]),
        COMPILE: Command(compile_argv),
        f"{COMPILE} (no .pyc cache)": Command(compile_argv, NO_BYTECODE_CACHE),
    }
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        workdir = Path(tmp)
        write_tiny(workdir)
        samples = interleaved(commands, workdir, args.repeats)
        own_ms = module_self_times(compile_argv[len(cli) :], workdir, args.repeats)

    base = median_seconds(samples[PASS])
    deps = median_seconds(samples[IMPORTS])
    rows = []
    for name, runs in samples.items():
        median = median_seconds(runs)
        rows.append(
            [
                name,
                f"{median:.3f}",
                f"{min(s.seconds for s in runs):.3f}",
                f"{median / base:.2f}x",
                f"{median / deps:.2f}x",
                f"{median_rss_mb(runs):.1f}",
            ]
        )
    print(f"whole-process times, median of {args.repeats} interleaved runs ({' '.join(cli)})")
    print_table(["command", "median s", "min s", "/ pass", "/ imports", "peak RSS MB"], rows)
    compile_s = median_seconds(samples[COMPILE])
    print()
    print(
        f"compile: {compile_s:.3f} s whole process (target < {TARGET_SECONDS} s: "
        f"{verdict(compile_s < TARGET_SECONDS)}); {compile_s - base:.3f} s above interpreter "
        f"start, {compile_s - deps:.3f} s above importing click, attrs, cattrs and yaml"
    )
    ratio = compile_s / deps
    print(
        f"compile / importing its dependencies alone: {ratio:.2f}x "
        f"(target <= {TARGET_RATIO}x: {verdict(ratio <= TARGET_RATIO)})"
    )
    used = median_seconds(samples[IMPORTS_USED])
    print(
        f"compile / importing only what it imports (click, attrs, yaml): {compile_s / used:.2f}x "
        f"({compile_s - used:.3f} s of the project's own start-up and work)"
    )
    slowest = sorted(own_ms.items(), key=lambda item: -item[1])
    print(
        "\n`python -X importtime` of the compile, median own time per project module "
        f"(target: none over {MODULE_SELF_MS:.0f} ms): "
        + ", ".join(f"{name} {ms:.1f} ms" for name, ms in slowest[:5])
        + f"; {len(own_ms)} modules, {sum(own_ms.values()):.1f} ms together: "
        + verdict(slowest[0][1] <= MODULE_SELF_MS)
    )
    return 0


def module_self_times(cli_args: list[str], workdir: Path, repeats: int) -> dict[str, float]:
    """Median own import time (ms) of every dflash_recipes module over `repeats` runs."""
    script = "from dflash_recipes.cli import run_cli; run_cli()"
    argv = [sys.executable, "-X", "importtime", "-c", script, *cli_args]
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        done = subprocess.run(
            argv, cwd=workdir, env=WITH_BYTECODE_CACHE, capture_output=True, text=True, check=True
        )
        for line in done.stderr.splitlines():
            # "import time: self [us] | cumulative | imported package"
            if not line.startswith("import time:") or "|" not in line:
                continue
            own, _, name = (part.strip() for part in line[len("import time:") :].split("|"))
            if name.startswith("dflash_recipes") and own.isdigit():
                times.setdefault(name, []).append(int(own) / 1000)
    return {name: statistics.median(values) for name, values in times.items()}


if __name__ == "__main__":
    raise SystemExit(main())
