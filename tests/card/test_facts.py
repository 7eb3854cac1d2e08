"""The card's data file: written and read back exactly, refused when damaged."""

from __future__ import annotations

import json

import attrs
import pytest
from testkit.card_samples import sample_facts

from dflash_recipes.card.facts import (
    CardDataError,
    Measurement,
    card_data_json,
    parse_card_data,
)


def test_the_data_file_reads_back_what_was_written() -> None:
    measured = Measurement(
        tau=2.5,
        tau_per_prompt_mean=None,
        block_size=16,
        drafted_tokens=15,
        max_new_tokens=64,
        num_prompts=8,
        thinking_mode="off",
        prompts_file="p.json",
        prompts_sha256="a" * 64,
        chat_template="tokenizer",
        chat_template_sha256=None,
        head="dflash (no head)",
        lossless=True,
        source="eval",
    )
    for facts in (sample_facts(), sample_facts(measured)):
        again = parse_card_data(card_data_json(facts))
        assert attrs.asdict(again) == attrs.asdict(facts)


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda d: d.update(dflash_card=2), "card data version 2"),
        (lambda d: d["facts"]["drafter"].update(block_size="16"), "does not match its layout"),
        (lambda d: d["facts"].update(extra=1), "does not match its layout"),
        (lambda d: d["facts"].pop("training"), "does not match its layout"),
    ],
)
def test_a_damaged_data_file_is_refused(edit: object, reason: str) -> None:
    data = json.loads(card_data_json(sample_facts()))
    edit(data)  # type: ignore[operator]
    with pytest.raises(CardDataError, match=reason):
        parse_card_data(json.dumps(data))
    with pytest.raises(CardDataError, match="not valid JSON"):
        parse_card_data("{")


def test_tau_per_workload_and_the_supervised_parts_are_rendered_and_read_back() -> None:
    from dflash_recipes.card.facts import TagMeasurement
    from dflash_recipes.card.render import render_card

    measured = Measurement(
        tau=2.5, tau_per_prompt_mean=2.4, block_size=16, drafted_tokens=15, max_new_tokens=64,
        num_prompts=8, thinking_mode="off", prompts_file="p.jsonl", prompts_sha256="a" * 64,
        chat_template="tokenizer", chat_template_sha256=None, head="dflash (no head)",
        lossless=True, source="eval",
        per_tag=(TagMeasurement("chat", 3.25, 5), TagMeasurement("tool", 1.5, 3)),
    )  # fmt: skip
    facts = sample_facts(measured)
    facts = attrs.evolve(
        facts, training=attrs.evolve(facts.training, supervised_parts=("answer", "tool_calls"))
    )
    text = render_card(facts)
    assert "| workload | prompts | tau (pooled) |" in text
    assert "| chat | 5 | 3.250 |" in text and "| tool | 3 | 1.500 |" in text
    assert "assistant tokens only (answer, tool_calls)" in text
    assert "assistant tokens only (" not in render_card(sample_facts(measured))  # every part
    assert "| workload |" not in render_card(sample_facts(attrs.evolve(measured, per_tag=())))
    again = parse_card_data(card_data_json(facts))
    assert attrs.asdict(again) == attrs.asdict(facts)
