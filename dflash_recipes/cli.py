"""`dflash-recipe`: a thin click shell over the library.

Every subcommand maps to one library call; the executor (torch) is imported only by the
subcommands that train, evaluate or export, so `compile`, `lint`, `schema` and `init` start
fast. User errors print a clean message and exit 1 (or 2 for usage problems); never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from dflash_recipes import __version__
from dflash_recipes.diagnostics import (
    Diagnostic,
    Severity,
    has_errors,
    render_github,
    render_text,
    sort_diagnostics,
    summary_line,
)
from dflash_recipes.errors import DFlashRecipeError

if TYPE_CHECKING:
    from dflash_recipes.compiler import CompileResult
    from dflash_recipes.plan import RunPlan

#: Loader codes that mean "the recipe file itself could not be read": a usage problem (exit 2).
UNREADABLE_CODES = frozenset({"recipe-not-found", "recipe-is-directory", "recipe-unreadable"})

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2


def _fail(message: str, code: int = EXIT_FINDINGS) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _print_diagnostics(diagnostics: Sequence[Diagnostic]) -> None:
    ordered = sort_diagnostics(diagnostics)
    if ordered:
        click.echo(render_text(ordered), err=True)


def _exit_code_for(diagnostics: Sequence[Diagnostic]) -> int:
    if any(d.code in UNREADABLE_CODES for d in diagnostics):
        return EXIT_USAGE
    return EXIT_FINDINGS if has_errors(diagnostics) else EXIT_OK


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, "--version", prog_name="dflash-recipe")
def main() -> None:
    """Typed, compiled recipes for training and fine-tuning DFlash drafters.

    \b
    Check a recipe, then run it:
      dflash-recipe compile recipes/Qwen/Qwen3-8B/hf_online_dflash_finetune.yaml -o plan.json
      dflash-recipe run plan.json
    """


# ---------------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------------


def _compile(recipe: str, overrides: Sequence[str]) -> CompileResult:
    from dflash_recipes.compiler import compile_file

    return compile_file(Path(recipe), overrides=tuple(overrides))


@main.command("compile")
@click.argument("recipe", type=click.Path(dir_okay=True, path_type=str))
@click.argument("overrides", nargs=-1)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write the run plan JSON here (only when compilation succeeds).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="text: diagnostics on stderr; json: one object on stdout.",
)
def compile_command(
    recipe: str, overrides: tuple[str, ...], output: Path | None, fmt: str
) -> None:
    """Compile RECIPE (plus a.b.c=value OVERRIDEs) into a fingerprinted run plan.

    Reads the base model's config.json and the init checkpoint's config.json and
    safetensors header (never tensor data) and cross-checks them.
    Exit 0: plan produced (warnings allowed); 1: the recipe has errors; 2: usage problem.

    \b
    Example:
      dflash-recipe compile recipe.yaml training.max_steps=100 -o plan.json
    """
    result = _compile(recipe, overrides)
    code = _exit_code_for(result.diagnostics)
    if result.plan is None and code == EXIT_OK:
        code = EXIT_FINDINGS
    if output is not None and result.plan is not None:
        _write_atomic(output, result.plan.to_json())
    if fmt == "json":
        payload = {
            "ok": result.plan is not None,
            "diagnostics": [d.to_json() for d in sort_diagnostics(result.diagnostics)],
            "plan": result.plan.to_dict() if result.plan is not None else None,
        }
        click.echo(json.dumps(payload, indent=2, sort_keys=True))
    else:
        _print_diagnostics(result.diagnostics)
        if result.plan is not None:
            where = f" -> {output}" if output is not None else ""
            click.echo(
                f"compiled {recipe}{where} (fingerprint {result.plan.fingerprint[:16]}; "
                f"{summary_line(result.diagnostics)})",
                err=True,
            )
            if output is None:
                click.echo(result.plan.to_json(), nl=False)
        else:
            click.echo(f"compile failed: {summary_line(result.diagnostics)}", err=True)
    sys.exit(code)


def _write_atomic(path: Path, text: str) -> None:
    """Write text to path through a temporary sibling, so a failure leaves no partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# ---------------------------------------------------------------------------------------------
# lint
# ---------------------------------------------------------------------------------------------


def _collect_recipe_files(paths: Sequence[str]) -> tuple[list[Path], list[str]]:
    files: list[Path] = []
    problems: list[str] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file()
            )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            problems.append(f"{raw}: no such file or directory")
    return files, problems


@main.command("lint")
@click.argument("paths", nargs=-1, required=True)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "github"]),
    default=None,
    help="Output format (default: github when GITHUB_ACTIONS=true, else text).",
)
@click.option("--strict", is_flag=True, help="Warnings fail too (exit 1).")
def lint_command(paths: tuple[str, ...], fmt: str | None, strict: bool) -> None:
    """Check recipe files and folders (recursive *.yaml/*.yml) at schema level.

    Structure, types, unknown keys and cross-field rules; no model or checkpoint files
    are read (use `compile` for that). Exit 0: clean; 1: findings; 2: usage problem.

    \b
    Example:
      dflash-recipe lint recipes/ --strict
    """
    from dflash_recipes.compiler import compile_recipe
    from dflash_recipes.loader import load_recipe_with_diagnostics

    if fmt is None:
        fmt = "github" if os.environ.get("GITHUB_ACTIONS") == "true" else "text"
    files, problems = _collect_recipe_files(paths)
    if problems:
        for problem in problems:
            click.echo(f"error: {problem}", err=True)
        sys.exit(EXIT_USAGE)
    all_diags: list[Diagnostic] = []
    for path in files:
        loaded = load_recipe_with_diagnostics(path)
        diags = list(loaded.diagnostics)
        if loaded.recipe is not None:
            result = compile_recipe(
                loaded.recipe, source=loaded.source, recipe_file=loaded.file, resolve=False
            )
            diags.extend(result.diagnostics)
        all_diags.extend(diags)
    all_diags = sort_diagnostics(all_diags)
    failing = [
        d
        for d in all_diags
        if d.severity is Severity.ERROR or (strict and d.severity is Severity.WARNING)
    ]
    summary = f"linted {len(files)} recipe file(s): {summary_line(all_diags)}"
    if fmt == "json":
        payload = {
            "ok": not failing,
            "files": [str(p) for p in files],
            "diagnostics": [d.to_json() for d in all_diags],
        }
        click.echo(json.dumps(payload, indent=2, sort_keys=True))
    else:
        if fmt == "github" and all_diags:
            click.echo(render_github(all_diags))
        if all_diags:
            click.echo(render_text(all_diags))
        click.echo(summary)
    sys.exit(EXIT_FINDINGS if failing else EXIT_OK)


# ---------------------------------------------------------------------------------------------
# schema / init
# ---------------------------------------------------------------------------------------------


@main.command("schema")
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write to a file."
)
def schema_command(output: Path | None) -> None:
    """Print the recipe's JSON Schema (for editor completion and validation).

    \b
    Example (VS Code YAML extension):
      dflash-recipe schema -o dflash-recipe.schema.json
      # then in a recipe:  # yaml-language-server: $schema=dflash-recipe.schema.json
    """
    from dflash_recipes.schema import recipe_json_schema

    text = json.dumps(recipe_json_schema(), indent=2, sort_keys=True) + "\n"
    if output is None:
        click.echo(text, nl=False)
    else:
        _write_atomic(output, text)
        click.echo(f"wrote {output}", err=True)


@main.command("init")
@click.option(
    "--base-model",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Local directory of the target model (with config.json).",
)
@click.option(
    "--init-checkpoint",
    type=click.Path(file_okay=False, path_type=Path),
    help="Local directory of an exported drafter to fine-tune (model.safetensors).",
)
@click.option("--output-dir", "run_output_dir", help="training.output_dir of the new recipe.")
@click.option("--data-path", help="data.data_path of the new recipe (JSONL conversations).")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the recipe here instead of stdout (refuses to overwrite).",
)
def init_command(
    base_model: Path,
    init_checkpoint: Path | None,
    run_output_dir: str | None,
    data_path: str | None,
    output: Path | None,
) -> None:
    """Write a recipe whose draft architecture, taps, mask id and block size are read
    from the init checkpoint (or sensible defaults from the base model without one).

    \b
    Example:
      dflash-recipe init --base-model /hf-local/Qwen/Qwen3-8B \\
          --init-checkpoint /hf-local/z-lab/Qwen3-8B-DFlash-b16 -o finetune.yaml
    """
    from dflash_recipes.init_recipe import render_init_recipe

    if output is not None and output.exists():
        _fail(f"{output} already exists; choose another -o path or delete it first", EXIT_USAGE)
    try:
        text = render_init_recipe(
            base_model, init_checkpoint, output_dir=run_output_dir, data_path=data_path
        )
    except DFlashRecipeError as exc:
        _fail(str(exc))
    if output is None:
        click.echo(text, nl=False)
    else:
        _write_atomic(output, text)
        click.echo(f"wrote {output}; check it with: dflash-recipe compile {output}", err=True)


# ---------------------------------------------------------------------------------------------
# executor commands (import torch lazily)
# ---------------------------------------------------------------------------------------------


def load_plan_or_recipe(path: str, overrides: Sequence[str]) -> RunPlan:
    """A `.json` plan as written by compile, or a recipe compiled now; exits on errors."""
    from dflash_recipes.plan import RunPlan

    candidate = Path(path)
    if candidate.suffix == ".json":
        if overrides:
            _fail(
                "overrides apply to recipes, not to compiled plans; pass the recipe "
                "instead, or recompile the plan with the overrides",
                EXIT_USAGE,
            )
        try:
            text = candidate.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            _fail(f"cannot read plan {path}: {exc}", EXIT_USAGE)
        try:
            return RunPlan.from_json(text)
        except DFlashRecipeError as exc:
            _fail(f"{path}: {exc}")
    result = _compile(path, overrides)
    _print_diagnostics(result.diagnostics)
    if result.plan is None:
        _fail(
            f"{path} did not compile ({summary_line(result.diagnostics)})",
            _exit_code_for(result.diagnostics) or EXIT_FINDINGS,
        )
    return result.plan


def run_cli() -> None:
    """Entry point wrapper: turn any library error escaping a command into a clean message."""
    try:
        main(standalone_mode=True)
    except DFlashRecipeError as exc:
        _fail(str(exc))


__all__ = ["load_plan_or_recipe", "main", "run_cli"]
