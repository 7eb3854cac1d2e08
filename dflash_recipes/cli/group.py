"""The `dflash-recipe` command group, its exit codes, and what every command shares.

Every subcommand maps to one library call; the executor (torch) is imported only by the
subcommands that train, evaluate or export, so `compile`, `lint`, `schema` and `init` start
fast. User errors print a clean message and exit 1 (or 2 for usage problems); never a traceback.
"""

from __future__ import annotations

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
    register_code,
    render_text,
    sort_diagnostics,
    summary_line,
)
from dflash_recipes.echo import bound_message
from dflash_recipes.errors import DFlashRecipeError, Interrupted

if TYPE_CHECKING:
    from dflash_recipes.compiler.compilation import CompileResult
    from dflash_recipes.plan.run_plan import RunPlan

#: Loader codes that mean "the recipe file itself could not be read": a usage problem (exit 2).
UNREADABLE_CODES = frozenset(
    {
        "recipe-not-found",
        "recipe-is-directory",
        "recipe-unreadable",
        "recipe-not-a-file",
        "recipe-too-large",
    }
)

OUTPUT_UNWRITABLE = register_code(
    "output-unwritable",
    Severity.ERROR,
    "The -o file cannot be written (missing permission, or a file where a folder should be).",
)

#: A plan.json is a few kilobytes; anything far larger is not one.
PLAN_MAX_BYTES = 16 * 2**20

# Parameter types, made once and shared by every command: each click.Path looks up a gettext
# translation when it is made (part of the start-up of every command).
_ANY_PATH_STR = click.Path(path_type=str)
_FILE = click.Path(dir_okay=False, path_type=Path)
_FILE_STR = click.Path(dir_okay=False, path_type=str)
_WRITABLE_FILE = click.Path(dir_okay=False, writable=True, path_type=Path)
_DIRECTORY = click.Path(file_okay=False, path_type=Path)
#: An input that may be a file or a folder (training-data inputs): the library says what is
#: wrong with it, naming the formats it reads.
_FILE_OR_FOLDER = click.Path(path_type=Path)

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2


def _fail(message: str, code: int = EXIT_FINDINGS) -> NoReturn:
    click.echo(f"error: {bound_message(message)}", err=True)
    sys.exit(code)


def _print_diagnostics(diagnostics: Sequence[Diagnostic]) -> None:
    ordered = sort_diagnostics(diagnostics)
    if ordered:
        click.echo(render_text(ordered), err=True)


def _exit_code_for(diagnostics: Sequence[Diagnostic]) -> int:
    if any(d.code in UNREADABLE_CODES for d in diagnostics):
        return EXIT_USAGE
    return EXIT_FINDINGS if has_errors(diagnostics) else EXIT_OK


class _Group(click.Group):
    """A group whose commands turn library errors into `error: ...` and exit 1, never a
    traceback, however they are invoked (console script, `python -m`, CliRunner)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except Interrupted as exc:  # a signal's one line, from rank 0 only; exit 128 + signum
            if os.environ.get("RANK", "0") == "0":
                click.echo(str(exc), err=True)
            ctx.exit(exc.exit_code)
        except DFlashRecipeError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(EXIT_FINDINGS)


@click.group(
    cls=_Group,
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
    from dflash_recipes.compiler.compilation import compile_file

    return compile_file(Path(recipe), overrides=tuple(overrides))


# ---------------------------------------------------------------------------------------------
# lint
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# schema / init
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# executor commands (import torch lazily)
# ---------------------------------------------------------------------------------------------


def load_plan_or_recipe(path: str, overrides: Sequence[str]) -> RunPlan:
    """A `.json` plan as written by compile, or a recipe compiled now; exits on errors."""
    from dflash_recipes.plan.run_plan import RunPlan

    candidate = Path(path)
    if candidate.suffix == ".json":
        if overrides:
            _fail(
                "overrides apply to recipes, not to compiled plans; pass the recipe "
                "instead, or recompile the plan with the overrides",
                EXIT_USAGE,
            )
        from dflash_recipes.files.jsonio import FileReadProblem, read_regular_file

        try:
            raw = read_regular_file(candidate, max_bytes=PLAN_MAX_BYTES)
        except FileReadProblem as exc:
            _fail(f"cannot read plan {path}: {exc.reason}", EXIT_USAGE)
        try:
            plan = RunPlan.from_json(raw)
        except DFlashRecipeError as exc:
            _fail(f"{path}: {exc}")
        _warn_remote_code(path, plan)
        return plan
    result = _compile(path, overrides)
    _print_diagnostics(result.diagnostics)
    if result.plan is None:
        _fail(
            f"{path} did not compile ({summary_line(result.diagnostics)})",
            _exit_code_for(result.diagnostics) or EXIT_FINDINGS,
        )
    _warn_remote_code(path, result.plan)
    return result.plan


def _warn_remote_code(path: str, plan: RunPlan) -> None:
    if plan.base_model.trust_remote_code:
        click.echo(
            f"warning: {path} has base_model.trust_remote_code on: Python code from "
            f"{plan.base_model.path} will run (a plan's fingerprint shows it is unchanged since "
            "it was compiled, not who compiled it)",
            err=True,
        )


def _setup_logging(verbose: bool) -> None:
    import logging

    rank = os.environ.get("RANK", "0")
    level = logging.INFO if rank == "0" else logging.WARNING
    if verbose:
        level = logging.DEBUG
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr, force=True)
    for noisy in ("httpx", "urllib3", "filelock", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded at run time
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def run_cli() -> None:
    """Entry point wrapper: turn any library error escaping a command into a clean message."""
    try:
        main(standalone_mode=True)
    except DFlashRecipeError as exc:
        _fail(str(exc))


__all__ = ["load_plan_or_recipe", "main", "run_cli"]
