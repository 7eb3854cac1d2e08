"""The commands that train: `run`, `capture`, `export` and `demo` (torch imported inside them)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dflash_recipes.cli.group import (
    _ANY_PATH_STR,
    _DIRECTORY,
    _FILE_STR,
    EXIT_FINDINGS,
    EXIT_USAGE,
    _fail,
    _setup_logging,
    load_plan_or_recipe,
    main,
)
from dflash_recipes.files.jsonio import clip
from dflash_recipes.recipe.choices import DTYPES

if TYPE_CHECKING:
    pass


@main.command("run")
@click.argument("recipe_or_plan", type=_ANY_PATH_STR)
@click.argument("overrides", nargs=-1)
@click.option("--nproc-per-node", type=click.IntRange(min=1), help="Launch N processes (torchrun).")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--rdzv-endpoint", help="HOST:PORT of the rendezvous for multi-node runs.")
@click.option("--rdzv-id", help="Rendezvous id shared by all nodes (default: plan fingerprint).")
@click.option(
    "--verify-capture",
    is_flag=True,
    help="Hash every shard of data.hidden_states_path before the first step "
    "(otherwise each shard is checked on its first use).",
)
@click.option(
    "--skip-memory-check",
    is_flag=True,
    help="Train even if the memory estimate says the plan will not fit the GPU (a warning "
    "states the device's memory and the estimate).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar (logs only).")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def run_command(
    recipe_or_plan: str,
    overrides: tuple[str, ...],
    nproc_per_node: int | None,
    nnodes: int,
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    verify_capture: bool,
    skip_memory_check: bool,
    no_progress: bool,
    verbose: bool,
) -> None:
    """Train as RECIPE_OR_PLAN says: convert, warm start or resume, train, checkpoint, export.

    A recipe is compiled first (with OVERRIDEs); a `.json` plan runs as compiled. Rerunning
    with the same training.output_dir resumes from its newest complete checkpoint.
    SIGTERM or SIGINT (Ctrl-C) stops every process after the step it is in, with a
    checkpoint of that step (exit 128 + the signal); SIGUSR1 saves a checkpoint and goes on.

    \b
    Examples:
      dflash-recipe run recipe.yaml training.max_steps=1000
      dflash-recipe run plan.json --nproc-per-node 8
      dflash-recipe run plan.json --nproc-per-node 8 --nnodes 2 --rdzv-endpoint node0:29500
    """
    from dflash_recipes.executor.dist_env import is_launched_process

    launching = nproc_per_node is not None or nnodes > 1
    if not launching and (rdzv_endpoint is not None or rdzv_id is not None):
        given = "--rdzv-endpoint" if rdzv_endpoint is not None else "--rdzv-id"
        _fail(
            f"{given} applies only to a torchrun launch, and this command starts none: add "
            "--nproc-per-node N (the processes on each node) and, for several nodes, --nnodes N, "
            "or drop the rendezvous options for a single-process run",
            EXIT_USAGE,
        )
    plan = load_plan_or_recipe(recipe_or_plan, overrides)
    if launching and not is_launched_process():
        from dflash_recipes.executor.launch import build_torchrun_argv, launch_torchrun

        argv = build_torchrun_argv(
            [recipe_or_plan, *overrides]
            + (["--no-progress"] if no_progress else [])
            + (["--verify-capture"] if verify_capture else [])
            + (["--skip-memory-check"] if skip_memory_check else [])
            + (["-v"] if verbose else []),
            nproc_per_node=nproc_per_node or 1,
            nnodes=nnodes,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_id=rdzv_id or (plan.fingerprint[:16] if rdzv_endpoint else None),
        )
        sys.exit(launch_torchrun(argv))
    _setup_logging(verbose)
    from dflash_recipes.executor.training.fit import run_plan

    # errors: the group's one handler
    summary = run_plan(
        plan,
        progress=not no_progress,
        verify_capture=verify_capture,
        skip_memory_check=skip_memory_check,
    )
    if os.environ.get("RANK", "0") == "0":
        from dflash_recipes.card.acceptance import run_gate_line
        from dflash_recipes.executor.training.summary import held_out_gap_line
        from dflash_recipes.executor.training.summary import summary_line as run_summary_line

        click.echo(run_summary_line(summary), err=True)
        gap = held_out_gap_line(summary)
        if gap is not None:
            click.echo(gap, err=True)
        # training.eval_min_tau: judged once the run is finished and exported (docs/dflash.md,
        # "The model card and the acceptance gate").
        gate = run_gate_line(plan) if summary.steps >= summary.planned_steps else None
        if gate is not None:
            click.echo(gate, err=True)
            sys.exit(EXIT_FINDINGS)


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
    from dflash_recipes.executor.dist_env import is_launched_process

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
        from dflash_recipes.executor.launch import build_torchrun_argv, launch_torchrun

        argv = build_torchrun_argv(
            [recipe_or_plan, *overrides, "--output", str(target), "--shard-mib", str(shard_mib)]
            + (["--no-progress"] if no_progress else [])
            + (["-v"] if verbose else []),
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
    from dflash_recipes.checkpoint.model_paths import resolve_local_path
    from dflash_recipes.recipe.loader import load_recipe_with_diagnostics

    loaded = load_recipe_with_diagnostics(Path(recipe), overrides=tuple(overrides))
    if loaded.recipe is None or loaded.recipe.data.hidden_states_path is None:
        return None
    base = resolve_local_path(recipe, base_dir=None).parent
    return str(resolve_local_path(loaded.recipe.data.hidden_states_path, base_dir=base))


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
    type=click.Choice(DTYPES),
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
