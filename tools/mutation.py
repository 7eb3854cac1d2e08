"""Mutation testing of the defensive modules: do the tests fail when a guard is broken?

    python tools/mutation.py                      # every group, one mutmut worker
    python tools/mutation.py locking crashsafe    # only these groups
    python tools/mutation.py --workers 2 --list   # name the groups and their files

Runs `mutmut` 3 (pip install mutmut) on the modules that refuse and protect (the safetensors
header reader, the compile checks, the checkpoint-field inventory, the plan checks, crash-safe
writes, the run lock, training checkpoints, the capture checks, the export target), each group
against only the tests that cover it, so a group takes minutes, not hours. Each group runs in its
own scratch copy under `.mutation/<group>/` (git-ignored, rebuilt on every run), so the working
tree is never mutated and groups never share stale results.

It prints one row per module (mutants, killed, survived, no test reached, kill ratio) and then
every surviving mutant as a diff. A survivor that `tools/mutation_survivors.md` explains (an
equivalent or harmless mutant, one sentence each, keyed by the mutant's name) is marked
"explained"; the ratio counts it as survived all the same. Exit status 1 when a module's kill
ratio is below `--min-ratio` (default 0.90).

Not part of `.ci/run`: the full run is CPU-heavy. Run it before changing a guard's tests.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = ROOT / ".mutation"
SURVIVORS_DOC = ROOT / "tools" / "mutation_survivors.md"

# mutmut's verdicts; a timeout or a type-check catch means the tests noticed the mutant.
_DETECTED = {"killed", "timeout", "caught by type check", "segfault"}


@dataclass(frozen=True)
class Group:
    """Modules mutated together and the tests that cover them."""

    name: str
    modules: tuple[str, ...]
    tests: tuple[str, ...]
    # Extra pytest arguments (for example a -k filter); the same for every mutant.
    pytest_args: tuple[str, ...] = ()


_PKG = "dflash_recipes/"

#: The compile checks are exercised through whole compiles, by the tests of every check family
#: (a taps warning is asserted where the checkpoint is tested); the capture tests are left out
#: (they capture with the tiny target first, which each mutant would have to repeat).
_COMPILE_TESTS = (
    *(
        f"tests/compiler/test_{name}.py"
        for name in (
            "checkpoint_checks",
            "id_checks",
            "input_checks",
            "recipe_checks",
            "server_checks",
            "field_checks",
            "compilation",
            "codes",
            "findings_pinned",
        )
    ),
    "tests/checkpoint/test_model_paths.py",
)

GROUPS: tuple[Group, ...] = (
    Group(
        "header",
        (_PKG + "checkpoint/safetensors_header.py",),
        ("tests/checkpoint/test_safetensors_header.py",),
    ),
    Group(
        "fields",
        (_PKG + "checkpoint/config_fields.py", _PKG + "compiler/field_checks.py"),
        ("tests/checkpoint/test_config_fields.py", "tests/compiler/test_field_checks.py"),
    ),
    *(
        Group(f"{name}-checks", (f"{_PKG}compiler/{name}_checks.py",), _COMPILE_TESTS)
        for name in ("checkpoint", "id", "recipe", "server")
    ),
    # the capture cross-check's inputs are gathered here: its tests capture once per run
    Group(
        "input-checks",
        (_PKG + "compiler/input_checks.py",),
        (*_COMPILE_TESTS, "tests/compiler/test_capture_checks.py"),
    ),
    Group(
        "plan",
        (_PKG + "plan/value_checks.py",),
        ("tests/plan/test_value_checks.py", "tests/plan/test_run_plan.py"),
    ),
    # the URL and output rules `compile` and `regenerate` share
    Group(
        "regenerate-settings",
        (_PKG + "plan/regenerate_settings.py",),
        ("tests/plan/test_regenerate_settings.py", "tests/compiler/test_server_checks.py"),
    ),
    # the URL rules, vLLM layer ids and `vllm serve` line `compile` and `serve-target` share
    Group(
        "target-server-settings",
        (_PKG + "plan/target_server_settings.py",),
        (
            "tests/plan/test_target_server_settings.py",
            "tests/compiler/test_server_checks.py",
            "tests/cli/test_serving.py",
        ),
    ),
    Group(
        "crashsafe",
        (_PKG + "files/crashsafe.py",),
        ("tests/files/test_crashsafe.py",),
    ),
    Group(
        "locking",
        (_PKG + "files/locking.py",),
        ("tests/files/test_locking.py",),
    ),
    Group(
        "checkpoints",
        (_PKG + "executor/training/checkpoints.py",),
        (
            "tests/executor/training/test_checkpoints.py",
            "tests/executor/training/test_checkpoints_io.py",
        ),
    ),
    Group(
        "capture",
        (_PKG + "compiler/capture_checks.py", _PKG + "files/capture_manifest.py"),
        # the capture and offline-reading tests run a tiny target per test: too slow per mutant
        ("tests/compiler/test_capture_checks.py", "tests/files/test_capture_manifest.py"),
    ),
    Group(
        "export-target",
        (_PKG + "files/export_target.py",),
        ("tests/files/test_export_target.py",),
    ),
)


@dataclass
class ModuleResult:
    """Verdicts of one module's mutants."""

    module: str
    verdicts: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return len(self.verdicts)

    def count(self, *statuses: str) -> int:
        return sum(1 for v in self.verdicts.values() if v in statuses)

    @property
    def detected(self) -> int:
        return self.count(*_DETECTED)

    @property
    def ratio(self) -> float:
        return self.detected / self.total if self.total else 1.0

    def survivors(self) -> list[str]:
        return sorted(
            (name for name, v in self.verdicts.items() if v not in _DETECTED),
            key=_natural,
        )


def _natural(name: str) -> tuple[str, int]:
    head, _, number = name.rpartition("__mutmut_")
    return head, int(number) if number.isdigit() else 0


def _dotted(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


# What the tests read besides the package and the tests (scripts they run, docs they check).
_ALSO_COPY = ("tools", "recipes", "benchmarks", "docs", "README.md", "CHANGELOG.md")


def _pyproject(group: Group) -> str:
    def toml_list(items: Sequence[str]) -> str:
        return "[" + ", ".join(f'"{item}"' for item in items) + "]"

    original = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    # Drop the repository's own [tool.mutmut] table, if any, and state this group's.
    original = re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[)", "", original)
    return (
        original
        + "\n[tool.mutmut]\n"
        + 'source_paths = ["dflash_recipes"]\n'
        + f"only_mutate = {toml_list(group.modules)}\n"
        + f"pytest_add_cli_args_test_selection = {toml_list(group.tests)}\n"
        + f"pytest_add_cli_args = {toml_list(['-p', 'no:cacheprovider', *group.pytest_args])}\n"
        + f"also_copy = {toml_list(_ALSO_COPY)}\n"
        + "use_git_change_detection = false\n"
    )


def _prepare(group: Group) -> Path:
    work = SCRATCH / group.name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for name in ("dflash_recipes", "tests", *_ALSO_COPY):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, work / name, ignore=ignore)
        elif (ROOT / name).is_file():
            shutil.copy2(ROOT / name, work / name)
    (work / "pyproject.toml").write_text(_pyproject(group), encoding="utf-8")
    return work


def _mutmut(work: Path, *args: str, capture: bool = True) -> str:
    env = dict(os.environ)
    # mutmut puts its mutated copy first on sys.path; a PYTHONPATH naming the working tree would
    # shadow it (and one naming the copy before it exists leaves a stale import cache).
    env.pop("PYTHONPATH", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    # Output goes to a file, not a pipe: mutmut finishes its run even if this script is stopped.
    log = work / f"mutmut-{args[0]}.log"
    with log.open("w", encoding="utf-8") as sink:
        done = subprocess.run(
            [sys.executable, "-m", "mutmut", *args],
            cwd=work,
            env=env,
            text=True,
            stdout=sink if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            check=False,
        )
    output = log.read_text(encoding="utf-8", errors="replace") if capture else ""
    if done.returncode != 0:
        msg = f"mutmut {' '.join(args)} failed with exit status {done.returncode} in {work}"
        raise SystemExit(f"{msg}\n{output[-4000:]}")
    return output


_RESULT_LINE = re.compile(r"^\s+(\S+__mutmut_\d+): (.+)$")


def run_group(
    group: Group, workers: int, *, quiet: bool, report_only: bool = False
) -> list[ModuleResult]:
    """Mutate `group.modules`, run their tests against each mutant, return the verdicts.

    `report_only`: read the verdicts of the last run from `.mutation/<group>` instead.
    """
    work = SCRATCH / group.name
    print(f"== {group.name}: {', '.join(group.modules)}", flush=True)
    if not report_only:
        work = _prepare(group)
        _mutmut(work, "run", "--max-children", str(workers), capture=quiet)
    results = {module: ModuleResult(module) for module in group.modules}
    prefixes = sorted(((_dotted(m) + ".", m) for m in group.modules), reverse=True)
    for line in _mutmut(work, "results", "--all", "true").splitlines():
        found = _RESULT_LINE.match(line)
        if found is None:
            continue
        name, status = found.groups()
        for prefix, module in prefixes:
            if name.startswith(prefix):
                results[module].verdicts[name] = status.strip()
                break
    return list(results.values())


def _explained() -> dict[str, str]:
    """Mutant name -> reason, from the `- `name`: reason` bullets of the survivors doc."""
    if not SURVIVORS_DOC.exists():
        return {}
    reasons: dict[str, str] = {}
    for line in SURVIVORS_DOC.read_text(encoding="utf-8").splitlines():
        found = re.match(r"^- `([^`]+__mutmut_\d+)`: (.+)$", line)
        if found:
            reasons[found.group(1)] = found.group(2)
    return reasons


def print_table(results: Sequence[ModuleResult]) -> None:
    header = ("module", "mutants", "killed", "survived", "no test", "not run", "kill ratio")
    rows = [
        (
            r.module.removeprefix(_PKG),
            str(r.total),
            str(r.detected),
            str(r.count("survived")),
            str(r.count("no tests")),
            str(r.count("not checked")),
            f"{r.ratio:.1%}",
        )
        for r in results
    ]
    total = sum(r.total for r in results)
    detected = sum(r.detected for r in results)
    rows.append(
        (
            "all",
            str(total),
            str(detected),
            str(sum(r.count("survived") for r in results)),
            str(sum(r.count("no tests") for r in results)),
            str(sum(r.count("not checked") for r in results)),
            f"{detected / total:.1%}" if total else "-",
        )
    )
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    line = "  ".join(
        h.ljust(w) if i == 0 else h.rjust(w)
        for i, (h, w) in enumerate(zip(header, widths, strict=True))
    )
    print(line)
    print("-" * len(line))
    for row in rows:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )


def _mutant_sources(work: Path, module: str) -> dict[str, list[str]]:
    """Function name -> source lines, for every function of the mutated copy of `module`."""
    path = work / "mutants" / module
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    sources: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "__mutmut_" in node.name:
            # the def line differs by name only; compare the bodies
            sources[node.name] = lines[node.lineno : node.end_lineno]
    return sources


def mutant_diff(work: Path, module: str, name: str, cache: dict[str, dict[str, list[str]]]) -> str:
    """The lines a mutant changed (- original, + mutant), read from mutmut's mutated copy."""
    if module not in cache:
        cache[module] = _mutant_sources(work, module)
    sources = cache[module]
    function = name.rpartition(".")[2]
    original = sources.get(function.rpartition("__mutmut_")[0] + "__mutmut_orig")
    mutated = sources.get(function)
    if original is None or mutated is None:
        return "    (source not found)"
    changed = difflib.unified_diff(original, mutated, lineterm="", n=0)
    return "\n".join(
        "    " + row.strip() if row[:1] not in "+-" else f"    {row[0]} {row[1:].strip()}"
        for row in changed
        if not row.startswith(("+++", "---", "@@"))
    )


def print_survivors(group_results: Sequence[tuple[Group, Sequence[ModuleResult]]]) -> None:
    reasons = _explained()
    for group, results in group_results:
        work = SCRATCH / group.name
        cache: dict[str, dict[str, list[str]]] = {}
        for result in results:
            for name in result.survivors():
                status = result.verdicts[name]
                note = reasons.get(name)
                label = f"explained: {note}" if note else "NOT explained"
                print(f"\n-- {name} ({status}; {label})")
                print(mutant_diff(work, result.module, name, cache))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("groups", nargs="*", help="group names (default: all)")
    parser.add_argument("--workers", type=int, default=1, help="mutmut workers (default 1)")
    parser.add_argument("--min-ratio", type=float, default=0.90)
    parser.add_argument("--list", action="store_true", help="list the groups and exit")
    parser.add_argument("--verbose", action="store_true", help="show mutmut's own progress")
    parser.add_argument(
        "--report", action="store_true", help="print the last run's results, run nothing"
    )
    args = parser.parse_args(argv)
    by_name = {g.name: g for g in GROUPS}
    if args.list:
        for g in GROUPS:
            print(f"{g.name}: {' '.join(g.modules)}\n    tests: {' '.join(g.tests)}")
        return 0
    unknown = [n for n in args.groups if n not in by_name]
    if unknown:
        parser.error(f"unknown group(s) {', '.join(unknown)}; choose from {', '.join(by_name)}")
    chosen = [by_name[n] for n in args.groups] if args.groups else list(GROUPS)
    done: list[tuple[Group, list[ModuleResult]]] = []
    failed: list[str] = []
    for group in chosen:
        try:
            done.append(
                (
                    group,
                    run_group(group, args.workers, quiet=not args.verbose, report_only=args.report),
                )
            )
        except SystemExit as exc:  # one group's failure (a red clean run) does not stop the rest
            print(exc, flush=True)
            failed.append(group.name)
            continue
        print_table(done[-1][1])
        print(flush=True)
    everything = [r for _, results in done for r in results]
    print()
    print_table(everything)
    print_survivors(done)
    if failed:
        print(f"\ngroups that could not run (see above): {', '.join(failed)}")
    low = [r.module for r in everything if r.ratio < args.min_ratio]
    if low:
        print(f"\nbelow {args.min_ratio:.0%}: {', '.join(low)}")
    if low or failed:
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
