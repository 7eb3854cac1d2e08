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
    register_code,
    render_github,
    render_text,
    sort_diagnostics,
    summary_line,
)
from dflash_recipes.errors import DFlashRecipeError
from dflash_recipes.files.crashsafe import write_new_file, write_output
from dflash_recipes.files.jsonio import clip, regular_file_problem

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


class _Group(click.Group):
    """A group whose commands turn library errors into `error: ...` and exit 1, never a
    traceback, however they are invoked (console script, `python -m`, CliRunner)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
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
def compile_command(recipe: str, overrides: tuple[str, ...], output: Path | None, fmt: str) -> None:
    """Compile RECIPE (plus a.b.c=value OVERRIDEs) into a fingerprinted run plan.

    Reads the base model's config.json and the init checkpoint's config.json and
    safetensors header (never tensor data) and cross-checks them.
    Exit 0: plan produced (warnings allowed); 1: the recipe has errors; 2: usage problem.

    \b
    Example:
      dflash-recipe compile recipe.yaml training.max_steps=100 -o plan.json
    """
    result = _compile(recipe, overrides)
    diagnostics = list(result.diagnostics)
    plan = result.plan
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
        }
        click.echo(json.dumps(payload, indent=2, sort_keys=True))
    else:
        _print_diagnostics(diagnostics)
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


# ---------------------------------------------------------------------------------------------
# lint
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# schema / init
# ---------------------------------------------------------------------------------------------


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
    "token or first unused embedding row).",
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


@main.command("run")
@click.argument("recipe_or_plan", type=_ANY_PATH_STR)
@click.argument("overrides", nargs=-1)
@click.option("--nproc-per-node", type=click.IntRange(min=1), help="Launch N processes (torchrun).")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--rdzv-endpoint", help="HOST:PORT of the rendezvous for multi-node runs.")
@click.option("--rdzv-id", help="Rendezvous id shared by all nodes (default: plan fingerprint).")
@click.option("--no-progress", is_flag=True, help="No progress bar (logs only).")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def run_command(
    recipe_or_plan: str,
    overrides: tuple[str, ...],
    nproc_per_node: int | None,
    nnodes: int,
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    no_progress: bool,
    verbose: bool,
) -> None:
    """Train as RECIPE_OR_PLAN says: convert, warm start or resume, train, checkpoint, export.

    A recipe is compiled first (with OVERRIDEs); a `.json` plan runs as compiled. Rerunning
    with the same training.output_dir resumes from its newest complete checkpoint.

    \b
    Examples:
      dflash-recipe run recipe.yaml training.max_steps=1000
      dflash-recipe run plan.json --nproc-per-node 8
      dflash-recipe run plan.json --nproc-per-node 8 --nnodes 2 --rdzv-endpoint node0:29500
    """
    from dflash_recipes.executor.distributed import is_launched_process

    plan = load_plan_or_recipe(recipe_or_plan, overrides)
    if (nproc_per_node is not None or nnodes > 1) and not is_launched_process():
        from dflash_recipes.executor.distributed import build_torchrun_argv, launch_torchrun

        argv = build_torchrun_argv(
            [recipe_or_plan, *overrides] + (["--no-progress"] if no_progress else []),
            nproc_per_node=nproc_per_node or 1,
            nnodes=nnodes,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_id=rdzv_id or (plan.fingerprint[:16] if rdzv_endpoint else None),
        )
        sys.exit(launch_torchrun(argv))
    _setup_logging(verbose)
    from dflash_recipes.executor.training.trainer import run_plan

    summary = run_plan(plan, progress=not no_progress)  # errors: the group's one handler
    if os.environ.get("RANK", "0") == "0":
        from dflash_recipes.executor.training.resume import summary_line as run_summary_line

        click.echo(run_summary_line(summary), err=True)


@main.command("capture")
@click.argument("recipe_or_plan", type=_ANY_PATH_STR)
@click.argument("overrides", nargs=-1)
@click.option(
    "--output",
    type=_DIRECTORY,
    help="Capture directory (default: the recipe's data.hidden_states_path).",
)
@click.option(
    "--shard-mib",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Most tensor data one shard holds, in MiB.",
)
@click.option("--nproc-per-node", type=click.IntRange(min=1), help="Launch N processes (torchrun).")
@click.option("--no-progress", is_flag=True, help="No progress bar (logs only).")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def capture_command(
    recipe_or_plan: str,
    overrides: tuple[str, ...],
    output: Path | None,
    shard_mib: int,
    nproc_per_node: int | None,
    no_progress: bool,
    verbose: bool,
) -> None:
    """Run the target over the training data once; write its taps for offline training.

    Writes safetensors shards and a manifest.json into --output (or data.hidden_states_path),
    with the plan's tokenization, chat template, truncation, loss masks and taps. A rerun
    resumes shard by shard. Then train with data.hidden_states_path set to the directory.

    \b
    Examples:
      dflash-recipe capture recipe.yaml --output /data/capture
      dflash-recipe capture recipe.yaml --output /data/capture --nproc-per-node 8
      dflash-recipe run recipe.yaml data.hidden_states_path=/data/capture
    """
    from dflash_recipes.executor.distributed import is_launched_process

    # The capture is what data.hidden_states_path will name: compile without it (a capture
    # that does not exist yet must not fail the compile), but take it as the default output.
    target = output
    if Path(recipe_or_plan).suffix == ".json":
        plan = load_plan_or_recipe(recipe_or_plan, overrides)
        if target is None and plan.data.hidden_states_path is not None:
            target = Path(plan.data.hidden_states_path)
    else:
        plan = load_plan_or_recipe(recipe_or_plan, (*overrides, "data.hidden_states_path=null"))
        if target is None:
            named = load_plan_or_recipe_capture_path(recipe_or_plan, overrides)
            target = Path(named) if named is not None else None
    if target is None:
        _fail(
            "no capture directory: pass --output DIR, or set data.hidden_states_path in the recipe",
            EXIT_USAGE,
        )
    if nproc_per_node is not None and not is_launched_process():
        from dflash_recipes.executor.distributed import build_torchrun_argv, launch_torchrun

        argv = build_torchrun_argv(
            [recipe_or_plan, *overrides, "--output", str(target), "--shard-mib", str(shard_mib)]
            + (["--no-progress"] if no_progress else []),
            nproc_per_node=nproc_per_node,
            command="capture",
        )
        sys.exit(launch_torchrun(argv))
    _setup_logging(verbose)
    from dflash_recipes.executor.data.capture import capture_plan

    summary = capture_plan(
        plan, target, max_shard_bytes=shard_mib * 2**20, progress=not no_progress
    )
    if os.environ.get("RANK", "0") == "0":
        click.echo(
            f"captured {summary.num_samples} samples, {summary.num_tokens} tokens in "
            f"{summary.shards} shards ({summary.bytes_on_disk} bytes, estimated "
            f"{summary.estimated_bytes}) into {summary.directory}",
            err=True,
        )


def load_plan_or_recipe_capture_path(recipe: str, overrides: Sequence[str]) -> str | None:
    """The recipe's data.hidden_states_path (absolute, against the recipe's folder), or None."""
    from dflash_recipes.compiler.model_paths import resolve_local_path
    from dflash_recipes.recipe.loader import load_recipe_with_diagnostics

    loaded = load_recipe_with_diagnostics(Path(recipe), overrides=tuple(overrides))
    if loaded.recipe is None or loaded.recipe.data.hidden_states_path is None:
        return None
    base = resolve_local_path(recipe, base_dir=None).parent
    return str(resolve_local_path(loaded.recipe.data.hidden_states_path, base_dir=base))


@main.command("eval")
@click.argument("plan_or_recipe", type=_ANY_PATH_STR)
@click.argument("overrides", nargs=-1)
@click.option(
    "--checkpoint",
    required=True,
    type=_DIRECTORY,
    help="An export directory or a training checkpoint directory.",
)
@click.option(
    "--prompts",
    type=_FILE,
    help="JSONL conversations whose first user turns are the prompts "
    "(default: data.eval_data_path).",
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--num-prompts", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def eval_command(
    plan_or_recipe: str,
    overrides: tuple[str, ...],
    checkpoint: Path,
    prompts: Path | None,
    max_new_tokens: int,
    num_prompts: int,
    as_json: bool,
) -> None:
    """Measure real acceptance: block drafting + greedy verification by the target.

    Reports the acceptance length tau pooled over all verification steps and as the mean
    of per-prompt means (z-lab's benchmark figure), the per-position acceptance rate, and
    checks that the output equals plain greedy decoding of the target (lossless).

    \b
    Example:
      dflash-recipe eval recipe.yaml --checkpoint outputs/run/export --prompts heldout.jsonl
    """
    plan = load_plan_or_recipe(plan_or_recipe, overrides)
    _setup_logging(False)
    from dflash_recipes.executor.evaluation.evaluate import run_eval

    report = run_eval(
        plan, checkpoint, prompts, max_new_tokens=max_new_tokens, num_prompts=num_prompts
    )
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, sort_keys=True))
        return
    rates = " ".join(f"{r:.2f}" for r in report.per_position_acceptance)
    click.echo(
        f"acceptance length tau, pooled over all verification steps: {report.tau_pooled:.3f} "
        f"(block size {report.block_size})"
    )
    click.echo(
        "acceptance length tau, mean of per-prompt means (z-lab's benchmark figure): "
        f"{report.tau_per_prompt_mean:.3f}"
    )
    click.echo(f"per-position acceptance (k=1..{report.block_size - 1}): {rates}")
    click.echo(
        f"{report.num_prompts} prompts, {report.steps} verification steps, "
        f"{report.tokens} tokens; lossless: {report.lossless}"
    )


@main.command("regenerate")
@click.argument("recipe_or_plan", type=_ANY_PATH_STR)
@click.argument("overrides", nargs=-1)
@click.option(
    "--input",
    "input_path",
    type=_FILE,
    help="JSONL conversations to answer (default: data.data_path).",
)
@click.option(
    "--output",
    "output_path",
    type=_FILE,
    help="The regenerated JSONL (default: regenerate.output_path); shards in OUTPUT.parts/.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def regenerate_command(
    recipe_or_plan: str,
    overrides: tuple[str, ...],
    input_path: Path | None,
    output_path: Path | None,
    no_progress: bool,
) -> None:
    """Answer the training prompts with the target itself (server or local generation).

    Every assistant turn is replaced by the target's answer, turn by turn. With
    regenerate.base_url set, an OpenAI-compatible server (vLLM, SGLang) answers; otherwise
    transformers runs model.model_name_or_path locally. A rerun with the same output resumes.

    \b
    Examples:
      dflash-recipe regenerate recipe.yaml regenerate.base_url=http://localhost:8000/v1 \\
          --output data/regenerated.jsonl
      dflash-recipe regenerate plan.json --input prompts.jsonl --output answers.jsonl
    """
    plan = load_plan_or_recipe(recipe_or_plan, overrides)
    _setup_logging(False)
    from dflash_recipes.executor.regenerate.job import run_regenerate

    try:
        run_regenerate(
            plan,
            input_path=input_path,
            output_path=output_path,
            progress=not no_progress,
            echo=lambda line: click.echo(line, err=True),
        )
    except KeyboardInterrupt:
        _fail(
            "interrupted; every answered conversation is kept: rerun the same command to continue",
            130,
        )


@main.command("export")
@click.argument("checkpoint_dir", type=_DIRECTORY)
@click.argument("out_dir", type=_DIRECTORY)
@click.option(
    "--plan",
    "plan_path",
    type=_FILE_STR,
    help="Plan or recipe of the run (default: the run's plan.json next to the checkpoint).",
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16", "float32"]),
    help="Export dtype (default: the plan's model dtype).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace OUT_DIR even if it is not an earlier export (never a run directory).",
)
def export_command(
    checkpoint_dir: Path, out_dir: Path, plan_path: str | None, dtype: str | None, force: bool
) -> None:
    """Export a training checkpoint in the z-lab layout serving engines load.

    OUT_DIR is created, or replaced if it holds an earlier export; anything else there is
    refused unless --force (a run directory is refused even then).

    \b
    Example:
      dflash-recipe export outputs/run/checkpoint-00005000 drafter-step5000/
    """
    from dflash_recipes.errors import ReplaceRefusedError
    from dflash_recipes.files.export_target import check_export_target
    from dflash_recipes.files.run_dir import PLAN_FILE

    try:  # before the plan and the model: a refused target costs nothing
        check_export_target(out_dir, force=force, sources=(checkpoint_dir,))
    except ReplaceRefusedError as exc:
        _fail(str(exc), EXIT_USAGE)
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte: before any work
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        _fail(f"cannot use OUT_DIR {clip(str(out_dir))}: {reason}; pass another path", EXIT_USAGE)
    out_dir = _export_target(out_dir)
    if plan_path is None:
        candidate = checkpoint_dir.parent / PLAN_FILE
        if not candidate.is_file():
            _fail(
                f"no {PLAN_FILE} next to {checkpoint_dir}; pass --plan PLAN_OR_RECIPE",
                EXIT_USAGE,
            )
        plan_path = str(candidate)
    plan = load_plan_or_recipe(plan_path, ())
    _setup_logging(False)
    from dflash_recipes.executor.model.export import export_checkpoint

    try:
        written = export_checkpoint(checkpoint_dir, plan, out_dir, dtype=dtype, force=force)
    except ReplaceRefusedError as exc:
        _fail(str(exc), EXIT_USAGE)
    click.echo(f"exported {checkpoint_dir} -> {written}")


def _export_target(out_dir: Path) -> Path:
    """OUT_DIR as an absolute, normalised path (exit 2 when it cannot be one).

    Which directories an export may replace is decided by
    :func:`dflash_recipes.files.export_target.check_export_target`.
    """
    try:
        return Path(os.path.normpath(os.path.abspath(out_dir)))
    except (OSError, ValueError) as exc:
        _fail(f"cannot use OUT_DIR {clip(str(out_dir))}: {exc}", EXIT_USAGE)


@main.command("report")
@click.argument("runs", nargs=-1, required=True, type=_DIRECTORY)
@click.option(
    "-o",
    "--output",
    type=_FILE,
    default=Path("report.png"),
    show_default=True,
)
@click.option("--label", "labels", multiple=True, help="Legend label per run (in order).")
def report_command(runs: tuple[Path, ...], output: Path, labels: tuple[str, ...]) -> None:
    """Plot a run's metrics (two runs: overlaid, e.g. warm start vs from scratch).

    Needs the plot extra: pip install 'dflash-recipes[plot]'.

    \b
    Example:
      dflash-recipe report runs/warm runs/scratch --label warm --label scratch -o cmp.png
    """
    from dflash_recipes.report import render_report

    written = render_report(list(runs), output, labels=list(labels) or None)
    click.echo(f"wrote {written}")


@main.command("demo")
@click.option(
    "--workdir",
    type=_DIRECTORY,
    default=Path("dflash-demo"),
    show_default=True,
    help="Where the tiny target, data and runs go (reused on a rerun).",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Delete the demo's previous runs first (only directories the demo created).",
)
def demo_command(workdir: Path, fresh: bool) -> None:
    """The embedded tiny warm-start demo: offline, about two minutes on 2 CPU cores.

    Compiles and trains a drafter from scratch, exports it, warm-start fine-tunes it at
    another block size, trains a from-scratch drafter for the same number of steps, and
    compares accuracy and measured acceptance length.

    \b
    Example:
      dflash-recipe demo --workdir /tmp/dflash-demo
    """
    _setup_logging(False)
    from dflash_recipes.executor.demo.runner import run_demo

    run_demo(workdir, fresh=fresh, echo=click.echo)


def run_cli() -> None:
    """Entry point wrapper: turn any library error escaping a command into a clean message."""
    try:
        main(standalone_mode=True)
    except DFlashRecipeError as exc:
        _fail(str(exc))


__all__ = ["load_plan_or_recipe", "main", "run_cli"]


if __name__ == "__main__":  # `python -m dflash_recipes.cli` (how torchrun starts workers)
    run_cli()
