"""The commands that measure: `eval` (acceptance of a drafter) and `report` (a PNG of runs)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from dflash_recipes.cli.group import (
    _ANY_PATH_STR,
    _DIRECTORY,
    _FILE,
    _FILE_OR_FOLDER,
    EXIT_FINDINGS,
    EXIT_USAGE,
    _fail,
    _setup_logging,
    load_plan_or_recipe,
    main,
)

if TYPE_CHECKING:
    from dflash_recipes.executor.evaluation.evaluate import AcceptanceReport


@main.command("eval")
@click.argument("plan_or_recipe", type=_ANY_PATH_STR)
@click.argument("overrides", nargs=-1)
@click.option(
    "--checkpoint",
    type=_DIRECTORY,
    help="An export directory or a training checkpoint directory (default: --write-card's).",
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
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Sampling temperature of the verification (0: greedy). Above 0 the target samples, "
    "and the rejection rule keeps its distribution whatever the drafter proposes.",
)
@click.option(
    "--draft-sampling",
    type=click.Choice(["sampled", "greedy"]),
    default="sampled",
    show_default=True,
    help="With --temperature > 0: draw each proposal from the drafter's distribution at that "
    "temperature, or propose its argmax (what engines without draft probabilities do).",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="With --temperature > 0: keep the k most likely tokens of every distribution, the "
    "target's and the drafter's (0: all).",
)
@click.option(
    "--top-p",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=1.0,
    show_default=True,
    help="With --temperature > 0: keep the most likely tokens whose probabilities reach P, "
    "after --top-k (1: all).",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="With --temperature > 0: the seed of every draw (same seed, same device: same tau).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--min-tau",
    type=click.FloatRange(min=0, min_open=True),
    help="Acceptance gate: exit 1, with one line saying measured against required, when the "
    "pooled tau is below this.",
)
@click.option(
    "--write-card",
    type=_DIRECTORY,
    metavar="EXPORT_DIR",
    help="Write the measured figures into this export's model card (README.md), regenerating "
    "it; the export must be the drafter measured (--checkpoint, if given, names it too).",
)
def eval_command(
    plan_or_recipe: str,
    overrides: tuple[str, ...],
    checkpoint: Path | None,
    prompts: Path | None,
    prompt_column: str | None,
    max_new_tokens: int,
    num_prompts: int,
    batch_size: int,
    enable_thinking: bool | None,
    temperature: float,
    draft_sampling: str,
    top_k: int,
    top_p: float,
    seed: int,
    as_json: bool,
    min_tau: float | None,
    write_card: Path | None,
) -> None:
    """Measure real acceptance: block drafting + verification by the target.

    Reports the acceptance length tau pooled over all verification steps and as the mean
    of per-prompt means (z-lab's benchmark figure), the per-position acceptance rate,
    tokens/s, and checks that the output equals plain greedy decoding of the target
    (lossless). For DFlash 2 it also measures tau with the head off (the unary argmax path
    beside the selector's, lossless too), so you see what the selector buys. The target
    keeps a KV cache cropped to the accepted tokens, so long generations (2k-16k tokens)
    cost linear time. --temperature T > 0 measures tau when the target samples at T: proposals
    are accepted by the rejection rule (lossless in distribution, so no greedy check), each
    drawn from the drafter at T (--draft-sampling greedy: its argmax), with --seed fixing the
    draws; --top-k and --top-p cut the target's and the drafter's distributions alike (the
    DFlash 2 blog measured at T 1.0, top-k 20, top-p 0.95). --json also
    records what makes tau comparable (block size, max_new_tokens, decoding and temperature,
    chat template and prompt file sha256, thinking mode, number of prompts).

    --min-tau X makes it a gate: exit 1 with one line (measured against required) when the
    pooled tau is below X, 0 otherwise. --write-card EXPORT_DIR regenerates that export's
    README.md with the measured figures (before the gate decides, so a failing measurement is
    on the card too).

    \b
    Examples:
      dflash-recipe eval recipe.yaml --checkpoint outputs/run/export --prompts heldout.jsonl
      dflash-recipe eval recipe.yaml --write-card outputs/run/export --min-tau 3.0
      dflash-recipe eval recipe.yaml --checkpoint outputs/run/export --temperature 1.0 \\
          --top-k 20 --top-p 0.95
    """
    if not math.isfinite(temperature):
        _fail(f"--temperature must be a finite number >= 0, got {temperature}", EXIT_USAGE)
    context = click.get_current_context()
    given = [
        f"--{name.replace('_', '-')}"
        for name in ("draft_sampling", "top_k", "top_p", "seed")
        if context.get_parameter_source(name) is not ParameterSource.DEFAULT
    ]
    if temperature == 0 and given:
        _fail(
            f"{' and '.join(given)} apply to sampled verification only; pass --temperature T "
            "(> 0) with them, or drop them for greedy verification",
            EXIT_USAGE,
        )
    checkpoint = _measured_directory(checkpoint, write_card)
    plan = load_plan_or_recipe(plan_or_recipe, overrides)
    _setup_logging(False)
    from dflash_recipes.executor.evaluation.evaluate import run_eval
    from dflash_recipes.executor.evaluation.sampling import Sampling

    sampling = (
        Sampling(
            temperature=temperature, seed=seed, drafts=draft_sampling, top_k=top_k, top_p=top_p
        )
        if temperature > 0
        else None
    )
    report = run_eval(
        plan,
        checkpoint,
        prompts,
        max_new_tokens=max_new_tokens,
        num_prompts=num_prompts,
        batch_size=batch_size,
        enable_thinking=enable_thinking,
        prompt_column=prompt_column,
        sampling=sampling,
    )
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        from dflash_recipes.checkpoint.kinds.registry import kind_facts

        head_name = kind_facts(plan.draft.architecture.projector_type).head_name
        _print_report(
            report, max_new_tokens=max_new_tokens, batch_size=batch_size, head_name=head_name
        )
    if write_card is not None:
        from dflash_recipes.card.acceptance import measurement_from_report
        from dflash_recipes.card.writer import write_card_measurement

        measured = measurement_from_report(report.to_dict(), source="eval")
        if measured is not None:
            click.echo(
                f"wrote the measurement into {write_card_measurement(write_card, measured)}",
                err=True,
            )
    if min_tau is not None:
        from dflash_recipes.card.acceptance import acceptance_shortfall

        line = acceptance_shortfall(report.tau, min_tau, setting="--min-tau")
        if line is not None:
            click.echo(line, err=True)
            sys.exit(EXIT_FINDINGS)


def _measured_directory(checkpoint: Path | None, write_card: Path | None) -> Path:
    """The directory `eval` measures: --checkpoint, else --write-card's export (exit 2 when
    neither is given, when they differ, or when the export has no card to write)."""
    if write_card is None:
        if checkpoint is None:
            _fail(
                "pass --checkpoint DIR (the drafter to measure) or --write-card EXPORT_DIR",
                EXIT_USAGE,
            )
        return checkpoint
    if checkpoint is not None and checkpoint.resolve() != write_card.resolve():
        _fail(
            f"--write-card {write_card} is not the --checkpoint measured ({checkpoint}); a card "
            "records the measurement of its own export: pass the same directory, or "
            "--write-card alone",
            EXIT_USAGE,
        )
    from dflash_recipes.card.writer import read_card
    from dflash_recipes.errors import CheckpointError

    try:  # before the models load: a card that cannot be written costs nothing
        read_card(write_card)
    except CheckpointError as exc:
        _fail(str(exc), EXIT_USAGE)
    return write_card


def _print_report(
    report: AcceptanceReport, *, max_new_tokens: int, batch_size: int, head_name: str | None
) -> None:
    rates = " ".join(f"{r:.2f}" for r in report.per_position_acceptance)
    click.echo(
        f"acceptance length tau, pooled over all verification steps: {report.tau_pooled:.3f} "
        f"(block size {report.block_size})"
    )
    click.echo(
        "acceptance length tau, mean of per-prompt means (z-lab's benchmark figure): "
        f"{report.tau_per_prompt_mean:.3f}"
    )
    if report.tau_per_tag:
        tags = ", ".join(
            f"{t.tag} {t.tau:.3f} ({t.num_prompts} prompt{'' if t.num_prompts == 1 else 's'})"
            for t in report.tau_per_tag
        )
        click.echo(f"acceptance length tau per workload tag, pooled: {tags}")
    click.echo(f"head measured: {report.head}, as the serving engine applies it")
    settings = report.settings
    sampled = settings is not None and settings.decoding == "sampling"
    if report.tau_without_head is not None:
        head = f"the {head_name} head" if head_name else "the head"
        gain = report.tau_pooled - report.tau_without_head
        own = "draws" if sampled else "argmax"
        click.echo(
            f"acceptance length tau without {head} (the backbone's own {own}), pooled: "
            f"{report.tau_without_head:.3f}; mean of per-prompt means: "
            f"{report.tau_without_head_per_prompt_mean or 0.0:.3f} ({head} adds {gain:+.3f})"
        )
    click.echo(f"per-proposal acceptance (k=1..{len(report.per_position_acceptance)}): {rates}")
    if settings is not None and sampled:
        from dflash_recipes.card.acceptance import decoding_description

        decoding = decoding_description(settings.to_dict())
        checked = f"{decoding}: lossless in distribution, no greedy check"
    else:
        checked = f"lossless: {report.lossless}"
    click.echo(
        f"{report.num_prompts} prompts, {report.steps} verification steps, "
        f"{report.tokens} tokens; {checked}"
    )
    if report.mismatched_prompts_without_head:
        click.echo(
            "with the head off, prompts "
            f"{', '.join(map(str, report.mismatched_prompts_without_head))} differ from greedy "
            "decoding of the target"
        )
    click.echo(
        f"{report.tokens_per_second:.1f} tokens/s (max_new_tokens {max_new_tokens}, "
        f"batch size {batch_size})"
    )
    if settings is not None:
        template = settings.chat_template_sha256 or "none"
        click.echo(
            f"thinking mode: {settings.thinking_mode}; chat template "
            f"({settings.chat_template_source}) sha256 {template[:12]}; "
            f"prompts sha256 {(settings.prompt_file_sha256 or '-')[:12]}"
        )
        if settings.held_out_slice is not None:
            click.echo(
                f"prompts: the data.eval_holdout slice of {settings.prompt_file} "
                f"({settings.held_out_slice}), held out of training"
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
