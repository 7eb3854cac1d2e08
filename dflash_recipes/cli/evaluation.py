"""The commands that measure: `eval` (acceptance of a drafter) and `report` (a PNG of runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dflash_recipes.cli.group import (
    _ANY_PATH_STR,
    _DIRECTORY,
    _FILE,
    _FILE_OR_FOLDER,
    _setup_logging,
    load_plan_or_recipe,
    main,
)

if TYPE_CHECKING:
    pass


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
    type=_FILE_OR_FOLDER,
    help="Prompts: .jsonl conversations (the turns before the first assistant turn), "
    ".json (a list of prompt strings or message lists), .parquet (--prompt-column), or "
    "conversations in any training-data format (.jsonl.gz, .arrow, a folder of such files, "
    "a `datasets` save_to_disk folder) (default: data.eval_data_path).",
)
@click.option(
    "--prompt-column",
    help="The Parquet column holding the prompts (default: the first of prompt, messages, "
    "conversations, question, problem, turns).",
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--num-prompts", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Prompts verified together as rows of one KV cache (tokens and tau do not change).",
)
@click.option(
    "--enable-thinking/--disable-thinking",
    default=None,
    help="Pass enable_thinking to the chat template (Qwen3-style); default: not passed.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def eval_command(
    plan_or_recipe: str,
    overrides: tuple[str, ...],
    checkpoint: Path,
    prompts: Path | None,
    prompt_column: str | None,
    max_new_tokens: int,
    num_prompts: int,
    batch_size: int,
    enable_thinking: bool | None,
    as_json: bool,
) -> None:
    """Measure real acceptance: block drafting + greedy verification by the target.

    Reports the acceptance length tau pooled over all verification steps and as the mean
    of per-prompt means (z-lab's benchmark figure), the per-position acceptance rate,
    tokens/s, and checks that the output equals plain greedy decoding of the target
    (lossless). The target keeps a KV cache cropped to the accepted tokens, so long
    generations (2k-16k tokens) cost linear time. Greedy only: sampling (temperature > 0)
    is not supported. --json also records what makes tau comparable (block size,
    max_new_tokens, chat template and prompt file sha256, thinking mode, number of prompts).

    \b
    Example:
      dflash-recipe eval recipe.yaml --checkpoint outputs/run/export --prompts heldout.jsonl
    """
    plan = load_plan_or_recipe(plan_or_recipe, overrides)
    _setup_logging(False)
    from dflash_recipes.executor.evaluation.evaluate import run_eval

    report = run_eval(
        plan,
        checkpoint,
        prompts,
        max_new_tokens=max_new_tokens,
        num_prompts=num_prompts,
        batch_size=batch_size,
        enable_thinking=enable_thinking,
        prompt_column=prompt_column,
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
    click.echo(f"head measured: {report.head}, as the serving engine applies it")
    click.echo(f"per-proposal acceptance (k=1..{len(report.per_position_acceptance)}): {rates}")
    click.echo(
        f"{report.num_prompts} prompts, {report.steps} verification steps, "
        f"{report.tokens} tokens; lossless: {report.lossless}"
    )
    click.echo(
        f"{report.tokens_per_second:.1f} tokens/s (max_new_tokens {max_new_tokens}, "
        f"batch size {batch_size})"
    )
    if report.settings is not None:
        settings = report.settings
        template = settings.chat_template_sha256 or "none"
        click.echo(
            f"thinking mode: {settings.thinking_mode}; chat template "
            f"({settings.chat_template_source}) sha256 {template[:12]}; "
            f"prompts sha256 {(settings.prompt_file_sha256 or '-')[:12]}"
        )


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
