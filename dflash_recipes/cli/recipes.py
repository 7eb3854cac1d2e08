"""The commands on recipe files: `compile`, `lint`, `schema` and `init` (no torch)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dflash_recipes.cli.group import (
    _ANY_PATH_STR,
    _DIRECTORY,
    _FILE,
    _WRITABLE_FILE,
    EXIT_FINDINGS,
    EXIT_OK,
    EXIT_USAGE,
    OUTPUT_UNWRITABLE,
    _compile,
    _exit_code_for,
    _fail,
    _print_diagnostics,
    main,
)
from dflash_recipes.diagnostics import (
    Diagnostic,
    Severity,
    render_github,
    render_text,
    sort_diagnostics,
    summary_line,
)
from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.files.crashsafe import write_new_file, write_output
from dflash_recipes.files.jsonio import clip, regular_file_problem

if TYPE_CHECKING:
    pass


@main.command("compile")
@click.argument("recipe", type=_ANY_PATH_STR)
@click.argument("overrides", nargs=-1)
@click.option(
    "-o",
    "--output",
    type=_WRITABLE_FILE,
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
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Ranks the resource plan is sized for (training.fsdp shards the target over them).",
)
@click.option(
    "--device-memory",
    type=click.FloatRange(min=0, min_open=True),
    metavar="GIB",
    help="Memory of one device in GiB: a plan needing more per rank is an error.",
)
@click.option(
    "--mfu",
    type=click.FloatRange(min=0, max=1, min_open=True),
    help="Print time per step and per epoch at this model-FLOPs utilisation (e.g. 0.4).",
)
@click.option(
    "--peak-tflops",
    type=click.FloatRange(min=0, min_open=True),
    help="Peak dense TFLOPS of one device, for --mfu (default 989: H100/H200 SXM bf16).",
)
def compile_command(
    recipe: str,
    overrides: tuple[str, ...],
    output: Path | None,
    fmt: str,
    world_size: int,
    device_memory: float | None,
    mfu: float | None,
    peak_tflops: float | None,
) -> None:
    """Compile RECIPE (plus a.b.c=value OVERRIDEs) into a fingerprinted run plan.

    Reads the base model's config.json and the init checkpoint's config.json and
    safetensors header (never tensor data) and cross-checks them, then estimates memory per
    rank, FLOPs per step and disk (docs/dflash.md, "Will it fit?").
    Exit 0: plan produced (warnings allowed); 1: the recipe has errors; 2: usage problem.

    \b
    Examples:
      dflash-recipe compile recipe.yaml training.max_steps=100 -o plan.json
      dflash-recipe compile recipe.yaml --world-size 8 --device-memory 80 --mfu 0.4
    """
    result = _compile(recipe, overrides)
    diagnostics = list(result.diagnostics)
    plan = result.plan
    compiled, resources, problem = plan, None, None
    if plan is not None:
        from dflash_recipes.compiler.resource_report import compile_resources

        resources, target, problem = compile_resources(plan, world_size=world_size)
        if resources is not None and device_memory is not None:
            from dflash_recipes.compiler.resource_report import device_diagnostic

            finding = device_diagnostic(
                plan, resources, device_memory, recipe_file=recipe, target=target
            )
            if finding is not None:
                diagnostics.append(finding)
                plan = None
    code = _exit_code_for(diagnostics)
    if plan is None and code == EXIT_OK:
        code = EXIT_FINDINGS
    if output is not None and plan is not None:
        try:
            write_output(output, plan.to_json())
        except OSError as exc:
            diagnostics.append(_unwritable(output, exc))
            plan, code = None, EXIT_USAGE
    if fmt == "json":
        payload = {
            "ok": plan is not None,
            "diagnostics": [d.to_json() for d in sort_diagnostics(diagnostics)],
            "plan": plan.to_dict() if plan is not None else None,
            "resources": resources.to_dict() if resources is not None else None,
        }
        click.echo(json.dumps(payload, indent=2, sort_keys=True))
    else:
        _print_diagnostics(diagnostics)
        if compiled is not None:
            from dflash_recipes.compiler.resource_report import render_for_compile

            text = render_for_compile(
                compiled, resources, problem, mfu=mfu, peak_tflops=peak_tflops
            )
            click.echo(text, err=True)
        if plan is not None:
            where = f" -> {output}" if output is not None else ""
            click.echo(
                f"compiled {recipe}{where} (fingerprint {plan.fingerprint[:16]}; "
                f"{summary_line(diagnostics)})",
                err=True,
            )
            if output is None:
                click.echo(plan.to_json(), nl=False)
        else:
            click.echo(f"compile failed: {summary_line(diagnostics)}", err=True)
    sys.exit(code)


def _unwritable(path: Path, exc: OSError) -> Diagnostic:
    return Diagnostic(
        severity=Severity.ERROR,
        code=OUTPUT_UNWRITABLE,
        path="",
        message=f"cannot write {path}: {exc.strerror or exc}",
        hint="choose an -o path in a folder you can write to (nothing was written)",
        file=str(path),
    )


RECIPE_SUFFIXES = (".yaml", ".yml")


def _recipes_under(folder: Path) -> list[Path]:
    """Every *.yaml / *.yml file below `folder`, skipping hidden files and folders.

    Hidden folders (`.git`, `.venv`, `.github`) hold YAML that is not a recipe; symlinked
    folders are not followed, so a link cycle cannot loop.
    """
    found: list[Path] = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(
            Path(root, name)
            for name in sorted(names)
            if name.endswith(RECIPE_SUFFIXES) and not name.startswith(".")
        )
    return [path for path in found if path.is_file()]


def _collect_recipe_files(paths: Sequence[str]) -> tuple[list[Path], list[str]]:
    """The files to lint (named files as given, folders searched), each once; and problems."""
    files: list[Path] = []
    problems: list[str] = []
    seen: set[str] = set()
    for raw in paths:
        path = Path(raw)
        unreadable = regular_file_problem(path)
        if unreadable is None:
            found = [path]
        elif os.path.isdir(path):
            found = _recipes_under(path)
            if not found:
                problems.append(f"{raw}: no recipe files (*.yaml, *.yml) in this folder")
        elif unreadable.missing:
            problems.append(f"{raw}: no such file or directory")
            continue
        else:
            problems.append(f"{clip(raw)}: {unreadable.reason}")
            continue
        for file in found:
            key = os.path.realpath(file)
            if key not in seen:
                seen.add(key)
                files.append(file)
    return files, problems


@main.command("lint")
@click.argument("paths", nargs=-1, required=True)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "github"]),
    default=None,
    help="Output format (default: github when GITHUB_ACTIONS=true, else text). github: "
    "workflow commands that annotate the files, then the text report.",
)
@click.option("--strict", is_flag=True, help="Warnings fail too (exit 1).")
def lint_command(paths: tuple[str, ...], fmt: str | None, strict: bool) -> None:
    """Check recipe files and folders (recursive *.yaml/*.yml) at schema level.

    Structure, types, unknown keys and cross-field rules; no model or checkpoint files
    are read (use `compile` for that). Hidden files and folders inside a folder are
    skipped. Exit 0: clean; 1: findings (errors; warnings too with --strict); 2: usage
    problem (a path that does not exist, a folder without recipes).

    \b
    Examples:
      dflash-recipe lint recipes/ --strict
      dflash-recipe lint recipes/ --format github    # in a GitHub Actions step
    """
    from dflash_recipes.compiler.compilation import compile_recipe
    from dflash_recipes.recipe.loader import load_recipe_with_diagnostics

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
        all_diags.extend(loaded.diagnostics)
        if loaded.recipe is not None:
            result = compile_recipe(
                loaded.recipe, source=loaded.source, recipe_file=loaded.file, resolve=False
            )
            all_diags.extend(result.diagnostics)
    all_diags = sort_diagnostics(all_diags)
    failing = [
        d
        for d in all_diags
        if d.severity is Severity.ERROR or (strict and d.severity is Severity.WARNING)
    ]
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
        click.echo(f"linted {len(files)} recipe file(s): {summary_line(all_diags)}")
    sys.exit(EXIT_FINDINGS if failing else EXIT_OK)


@main.command("schema")
@click.option("-o", "--output", type=_FILE, help="Write to a file.")
def schema_command(output: Path | None) -> None:
    """Print the recipe's JSON Schema (for editor completion and validation).

    \b
    Example (VS Code YAML extension):
      dflash-recipe schema -o dflash-recipe.schema.json
      # then in a recipe:  # yaml-language-server: $schema=dflash-recipe.schema.json
    """
    from dflash_recipes.recipe.json_schema import recipe_json_schema

    text = json.dumps(recipe_json_schema(), indent=2, sort_keys=True) + "\n"
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        write_output(output, text)
    except OSError as exc:
        _fail(f"cannot write {output}: {exc.strerror or exc}", EXIT_USAGE)
    click.echo(f"wrote {output}", err=True)


@main.command("init")
@click.option(
    "--base-model",
    required=True,
    type=_DIRECTORY,
    help="Local directory of the target model (with config.json).",
)
@click.option(
    "--init-checkpoint",
    type=_DIRECTORY,
    help="Local directory of an exported drafter to fine-tune (model.safetensors).",
)
@click.option(
    "--mask-token-id",
    type=click.IntRange(min=0),
    help="dflash_mask_token_id (default: the checkpoint's; without one, the tokenizer's mask "
    "token, its first unused embedding row, or its first reserved special token).",
)
@click.option("--output-dir", "run_output_dir", help="training.output_dir of the new recipe.")
@click.option("--data-path", help="data.data_path of the new recipe (JSONL conversations).")
@click.option(
    "-o",
    "--output",
    type=_FILE,
    help="Write the recipe here instead of stdout (refuses to overwrite).",
)
def init_command(
    base_model: Path,
    init_checkpoint: Path | None,
    mask_token_id: int | None,
    run_output_dir: str | None,
    data_path: str | None,
    output: Path | None,
) -> None:
    """Write a recipe whose draft architecture, taps, mask id and block size are read
    from the init checkpoint (or sensible defaults from the base model without one).

    \b
    Examples:
      dflash-recipe init --base-model /hf-local/Qwen/Qwen3-8B \\
          --init-checkpoint /hf-local/z-lab/Qwen3-8B-DFlash-b16 -o finetune.yaml
      dflash-recipe init --base-model /hf-local/Qwen/Qwen3-8B --mask-token-id 151669 \\
          --data-path train.jsonl -o scratch.yaml
    """
    from dflash_recipes.recipe.starter import render_init_recipe

    try:
        taken = output is not None and os.path.lexists(output)
    except (OSError, ValueError) as exc:  # lexists swallows most; keep any other out too
        _fail(f"cannot use -o {clip(str(output))}: {exc}", EXIT_USAGE)
    if taken:
        _fail(f"{output} already exists; choose another -o path or delete it first", EXIT_USAGE)
    try:
        text = render_init_recipe(
            base_model,
            init_checkpoint,
            output_dir=run_output_dir,
            data_path=data_path,
            mask_token_id=mask_token_id,
            recipe_path=str(output) if output is not None else None,
        )
    except DFlashRecipeError as exc:
        _fail(str(exc))
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        written = write_new_file(output, text)
    except OSError as exc:
        _fail(f"cannot write {output}: {exc.strerror or exc}", EXIT_USAGE)
    if not written:
        _fail(f"{output} already exists; choose another -o path or delete it first", EXIT_USAGE)
    click.echo(f"wrote {output}; check it with: dflash-recipe compile {output}", err=True)
