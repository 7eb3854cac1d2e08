"""The `regenerate` command: training conversations answered by the target itself."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from dflash_recipes.cli.group import (
    _ANY_PATH_STR,
    _FILE,
    _FILE_OR_FOLDER,
    _setup_logging,
    load_plan_or_recipe,
    main,
)

if TYPE_CHECKING:
    pass


@main.command("regenerate")
@click.argument("recipe_or_plan", type=_ANY_PATH_STR)
@click.argument("overrides", nargs=-1)
@click.option(
    "--input",
    "input_path",
    type=_FILE_OR_FOLDER,
    help="Conversations to answer, in any training-data format: a JSONL (or .jsonl.gz), "
    "Parquet or Arrow file, a folder of them, or a `datasets` save_to_disk folder "
    "(default: data.data_path).",
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
    from dflash_recipes.executor.signals import RaiseOnStopSignals, stopped_regenerate

    try:
        with RaiseOnStopSignals():  # SIGTERM seals the journal as Ctrl-C does
            run_regenerate(
                plan,
                input_path=input_path,
                output_path=output_path,
                progress=not no_progress,
                echo=lambda line: click.echo(line, err=True),
            )
    except KeyboardInterrupt as exc:
        raise stopped_regenerate(exc) from None
