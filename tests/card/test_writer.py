"""`eval --write-card`'s library side: the card is regenerated from its data, never appended
to, and an export without card data is refused with what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.card_samples import sample_facts

from dflash_recipes.card.facts import CARD_DATA_FILE, CARD_FILE, Measurement, card_data_json
from dflash_recipes.card.render import render_card
from dflash_recipes.card.writer import read_card, write_card_measurement
from dflash_recipes.errors import CheckpointError


def _measured(tau: float) -> Measurement:
    return Measurement(
        tau=tau,
        tau_per_prompt_mean=tau,
        block_size=16,
        drafted_tokens=15,
        max_new_tokens=64,
        num_prompts=8,
        thinking_mode="off",
        prompts_file="bench.json",
        prompts_sha256="a" * 64,
        chat_template="tokenizer",
        chat_template_sha256="b" * 64,
        head="dflash (no head)",
        lossless=True,
        source="eval",
    )


def _export(tmp_path: Path) -> Path:
    out = tmp_path / "export"
    out.mkdir()
    (out / CARD_DATA_FILE).write_text(card_data_json(sample_facts()), encoding="utf-8")
    (out / CARD_FILE).write_text(render_card(sample_facts()), encoding="utf-8")
    return out


def test_a_measurement_replaces_the_last_one(tmp_path: Path) -> None:
    out = _export(tmp_path)
    assert "Not measured." in (out / CARD_FILE).read_text(encoding="utf-8")
    write_card_measurement(out, _measured(2.125))
    write_card_measurement(out, _measured(3.375))
    text = (out / CARD_FILE).read_text(encoding="utf-8")
    assert "**3.375**" in text and "2.125" not in text and "Not measured." not in text
    assert text.count("## What it measured") == 1
    assert "| measured by | `dflash-recipe eval` of these weights |" in text
    assert read_card(out).measurement == _measured(3.375)
    assert sorted(p.name for p in out.iterdir()) == [CARD_DATA_FILE, CARD_FILE]  # no leftovers


def test_an_export_without_card_data_is_refused(tmp_path: Path) -> None:
    bare = tmp_path / "old-export"
    bare.mkdir()
    with pytest.raises(CheckpointError, match="it has no card data; --write-card takes a"):
        write_card_measurement(bare, _measured(2.0))
    (bare / CARD_DATA_FILE).write_text("{not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"its card data is damaged \(not valid JSON"):
        read_card(bare)
    assert not (bare / CARD_FILE).exists()
