"""The units of work of regenerate: reasoning policies applied to an answer."""

from __future__ import annotations

from dflash_recipes.executor.regenerate.types import apply_reasoning


def test_apply_reasoning_policies() -> None:
    assert apply_reasoning("answer", "because", "keep") == "<think>\nbecause\n</think>\n\nanswer"
    assert apply_reasoning("answer", "because", "drop") == "answer"
    assert apply_reasoning("<think>a</think>\n\nb <think>c</think>d", None, "drop") == "b d"
    assert apply_reasoning("half a thought</think>answer", None, "drop") == "answer"
    assert apply_reasoning("answer <think>cut off", None, "drop") == "answer"
