"""Write an export's model card, at export time and again when `eval --write-card` measures it.

- :func:`write_model_card`: called by the export (``export_drafter``) on its staging directory,
  after the weights and config.json and before the export marker, so the card is published
  with the weights or not at all. A re-export writes a new directory: the card is regenerated
  from the new facts, never appended to.
- :func:`write_card_measurement`: `eval --write-card EXPORT_DIR` replaces the card's
  measurement and renders the card again from the card's data file (:data:`CARD_DATA_FILE`),
  each file replaced atomically (a crash leaves the old file or the new one).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs

from dflash_recipes.card.facts import (
    CARD_DATA_FILE,
    CARD_FILE,
    CardDataError,
    CardFacts,
    Measurement,
    card_data_json,
    parse_card_data,
)
from dflash_recipes.card.gather import export_card_facts
from dflash_recipes.card.render import render_card
from dflash_recipes.errors import CheckpointError
from dflash_recipes.files.crashsafe import write_text_atomic
from dflash_recipes.files.jsonio import FileReadProblem, read_regular_file
from dflash_recipes.plan.run_plan import RunPlan

#: A card's data file is a few kilobytes; anything far larger is not one.
_CARD_DATA_LIMIT = 4 * 2**20


def _write(export_dir: Path, facts: CardFacts) -> Path:
    # The data first: README.md is rendered from it, so a card interrupted between the two is
    # rendered right by the next write.
    write_text_atomic(export_dir / CARD_DATA_FILE, card_data_json(facts))
    write_text_atomic(export_dir / CARD_FILE, render_card(facts))
    return export_dir / CARD_FILE


def write_model_card(
    export_dir: Path,
    plan: RunPlan,
    *,
    sources: Sequence[Path] = (),
    serving_notes: Sequence[str] = (),
) -> Path:
    """Write README.md and its data into `export_dir`, which already holds the exported
    model.safetensors and config.json; returns the README's path.

    `sources` are what the export read (a training checkpoint, or nothing for the export at
    the end of `run`); `serving_notes` say why engines serve the head otherwise than trained.
    """
    facts = export_card_facts(plan, export_dir, sources=sources, serving_notes=serving_notes)
    return _write(export_dir, facts)


def read_card(export_dir: Path) -> CardFacts:
    """The card data of an export; CheckpointError (what, where, the fix) when it has none."""
    path = export_dir / CARD_DATA_FILE
    try:
        return parse_card_data(read_regular_file(path, max_bytes=_CARD_DATA_LIMIT))
    except FileReadProblem as exc:
        reason = "it has no card data" if exc.missing else f"its card data: {exc.reason}"
    except CardDataError as exc:
        reason = f"its card data is damaged ({exc})"
    msg = (
        f"cannot write the card of {export_dir}: {reason}; --write-card takes a directory "
        "written by `dflash-recipe export` or `run` (re-export older exports to give them a card)"
    )
    raise CheckpointError(msg)


def write_card_measurement(export_dir: Path, measurement: Measurement) -> Path:
    """Regenerate the card of `export_dir` with `measurement`; returns the README's path."""
    facts = read_card(export_dir)
    return _write(export_dir, attrs.evolve(facts, measurement=measurement))


__all__ = ["read_card", "write_card_measurement", "write_model_card"]
