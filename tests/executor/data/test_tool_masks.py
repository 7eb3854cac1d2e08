"""Tool calls, tool results, reasoning and `tools` through a real chat template with tool support
(issue 52): exactly the parts data.supervise names keep their loss, token by token, under a
template with generation markers (the tiny demo's) and one masked by rendering (Qwen3's layout);
a template that drops tools or tool calls is an error naming the part, or a counted skip."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from testkit.fuzzing import FUZZ
from testkit.tool_chat import (
    PLAIN_TEMPLATE,
    QUESTION,
    QWEN_STYLE_TEMPLATE,
    TOOL_RESULT,
    tool_row,
    tool_tokenizer,
)

from dflash_recipes.data.conversations import Conversation, conversation_of
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.token_build import tokenize_all
from dflash_recipes.executor.data.token_cache import TokenizeSettings
from dflash_recipes.executor.data.tokenize import UnrenderablePart, tokenize_conversation
from dflash_recipes.executor.demo.tiny_tokenizer import TINY_CHAT_TEMPLATE

CALL_QWEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_TINY = '<call>{"name": "get_weather", "arguments": {"city": "Paris"}}</call>'
THINK_1 = "<think>\nThe user wants the weather, so call the tool first.\n</think>\n"
THINK_2 = "<think>\nThe tool said sunny and 18.\n</think>\n"
ANSWER = "Paris is sunny at 18 degrees today."
END = "<|im_end|>"

#: Per template: the supervised runs of text each setting of data.supervise gives. The turn's
#: end goes with any part of it that is supervised; a turn with none loses its end too.
#: (Qwen's layout puts a blank line after </think>, the tiny template one newline.)
EXPECTED = {
    "qwen": {
        ("answer", "tool_calls", "reasoning"): [
            THINK_1 + "\n" + CALL_QWEN + END,
            THINK_2 + "\n" + ANSWER + END,
        ],
        ("answer",): [ANSWER + END],
        ("tool_calls",): [CALL_QWEN + END],
        ("reasoning",): [THINK_1 + "\n", END, THINK_2 + "\n", END],
        ("answer", "tool_calls"): [CALL_QWEN + END, ANSWER + END],
    },
    "tiny": {
        ("answer", "tool_calls", "reasoning"): [
            THINK_1 + CALL_TINY + END,
            THINK_2 + ANSWER + END,
        ],
        ("answer",): [ANSWER + END],
        ("tool_calls",): [CALL_TINY + END],
        ("reasoning",): [THINK_1, END, THINK_2, END],
        ("answer", "tool_calls"): [CALL_TINY + END, ANSWER + END],
    },
}
TEMPLATES = {"qwen": QWEN_STYLE_TEMPLATE, "tiny": TINY_CHAT_TEMPLATE}


def _conversation() -> Conversation:
    conversation = conversation_of(1, tool_row(), answer_only_loss=True)
    assert isinstance(conversation, Conversation)
    return conversation


def _supervised_runs(template: str, supervise: tuple[str, ...]) -> list[str]:
    tok = tool_tokenizer()
    conversation = _conversation()
    example = tokenize_conversation(
        tok,
        conversation.messages,
        chat_template=template,
        answer_only_loss=True,
        max_len=4096,
        tools=conversation.tools,
        supervise=supervise,
    )
    runs: list[str] = []
    current: list[int] = []
    for token, supervised in zip(example.input_ids, example.loss_mask, strict=True):
        if supervised:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


@pytest.mark.parametrize("name", ["qwen", "tiny"])
@pytest.mark.parametrize("supervise", list(EXPECTED["qwen"]))
def test_exactly_the_named_parts_are_supervised(name: str, supervise: tuple[str, ...]) -> None:
    assert _supervised_runs(TEMPLATES[name], supervise) == EXPECTED[name][supervise]


@pytest.mark.parametrize("name", ["qwen", "tiny"])
def test_tool_results_system_user_and_schemas_are_never_supervised(name: str) -> None:
    runs = "".join(_supervised_runs(TEMPLATES[name], ("answer", "tool_calls", "reasoning")))
    for text in (TOOL_RESULT, QUESTION, "weather assistant", 'get_weather", "description'):
        assert text not in runs


@pytest.mark.parametrize("name", ["qwen", "tiny"])
def test_the_tools_and_the_calls_are_rendered_by_the_template(name: str) -> None:
    tok = tool_tokenizer()
    conversation = _conversation()
    example = tokenize_conversation(
        tok,
        conversation.messages,
        chat_template=TEMPLATES[name],
        answer_only_loss=False,
        max_len=4096,
        tools=conversation.tools,
    )
    text = tok.decode(example.input_ids)
    assert '"description": "Today\'s weather in a city"' in text  # the schema, via `tools`
    assert (CALL_QWEN if name == "qwen" else CALL_TINY) in text
    assert TOOL_RESULT in text
    assert np.all(np.asarray(example.loss_mask) == 1)


def test_a_template_without_tool_support_is_an_error_naming_the_part() -> None:
    conversation = _conversation()
    with pytest.raises(UnrenderablePart, match=r"renders the row's 'tools' the same as no tools"):
        tokenize_conversation(
            tool_tokenizer(), conversation.messages, chat_template=PLAIN_TEMPLATE,
            answer_only_loss=True, max_len=4096, tools=conversation.tools,
        )  # fmt: skip
    with pytest.raises(UnrenderablePart, match=r"leaves out messages\[2\]\.tool_calls"):
        tokenize_conversation(
            tool_tokenizer(), conversation.messages, chat_template=PLAIN_TEMPLATE,
            answer_only_loss=True, max_len=4096, tools=None,
        )  # fmt: skip


@pytest.mark.parametrize("choice", ["skip", "error"])
def test_unrenderable_rows_are_counted_skips_or_a_stop(choice: str) -> None:
    settings = TokenizeSettings(PLAIN_TEMPLATE, True, 4096, 4, unrenderable_rows=choice)
    turns = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]
    plain = conversation_of(2, {"messages": turns}, answer_only_loss=True)
    assert isinstance(plain, Conversation)
    if choice == "skip":
        result = tokenize_all([_conversation(), plain], tool_tokenizer(), settings)
        assert len(result.lengths) == 1  # the plain row trains
        assert [(line, kind) for line, kind, _ in result.skipped] == [(1, "unrenderable part")]
    else:
        with pytest.raises(DataError) as raised:
            tokenize_all([_conversation(), plain], tool_tokenizer(), settings)
        assert str(raised.value) == (
            "data row 1 (unrenderable part, data.unrenderable_rows: error): the chat template "
            "renders the row's 'tools' the same as no tools (it has no tool support); set "
            "data.chat_template to a template that renders tools, or data.unrenderable_rows: "
            "skip to leave such rows out"
        )


# ---------------------------------------------------------------------------------------------
# whatever a readable row holds, tokenizing it gives a mask or a DataError (property test)
# ---------------------------------------------------------------------------------------------

_texts = st.text(alphabet=st.sampled_from("ab <>{}\"'\n\\%#"), max_size=12)
_calls = st.lists(
    st.fixed_dictionaries(
        {
            "function": st.fixed_dictionaries(
                {
                    "name": _texts.filter(lambda t: t.strip() != ""),
                    "arguments": st.dictionaries(_texts, _texts | st.integers(), max_size=2),
                }
            )
        },
        optional={"id": _texts},
    ),
    max_size=2,
)
_turns = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _texts},
        optional={"tool_calls": _calls, "reasoning_content": _texts, "tool_call_id": _texts},
    ),
    min_size=1,
    max_size=5,
)


@FUZZ
@given(
    turns=_turns,
    tools=st.none() | st.just([tool_row()["tools"][0]]),
    name=st.sampled_from(["qwen", "tiny", "plain"]),
    supervise=st.sets(st.sampled_from(["answer", "tool_calls", "reasoning"]), min_size=1),
    answer_only_loss=st.booleans(),
)
def test_any_readable_row_tokenizes_or_is_a_data_error(
    turns: list[dict[str, object]],
    tools: list[dict[str, object]] | None,
    name: str,
    supervise: set[str],
    answer_only_loss: bool,
) -> None:
    for turn in turns:  # the reader refuses calls outside assistant turns (tested above)
        if turn["role"] != "assistant":
            turn.pop("tool_calls", None)
    row = {"messages": turns} if tools is None else {"messages": turns, "tools": tools}
    conversation = conversation_of(1, row, answer_only_loss=False)
    assert isinstance(conversation, Conversation)
    template = {**TEMPLATES, "plain": PLAIN_TEMPLATE}[name]
    try:
        example = tokenize_conversation(
            tool_tokenizer(),
            conversation.messages,
            chat_template=template,
            answer_only_loss=answer_only_loss,
            max_len=512,
            tools=conversation.tools,
            supervise=tuple(sorted(supervise)),
        )
    except DataError:
        return
    assert len(example.input_ids) == len(example.loss_mask) <= 512
    assert set(example.loss_mask) <= {0, 1}


def test_a_template_that_refuses_a_turn_stops_the_build_naming_the_row_and_the_fix() -> None:
    refusing = (
        "{%- for m in messages -%}{%- if m['role'] == 'tool' -%}"
        "{{ raise_exception('tool turns are not supported') }}{%- endif -%}"
        "{{- m['role'] + ': ' + m['content'] + '\\n' -}}{%- endfor -%}"
    )
    settings = TokenizeSettings(refusing, True, 4096, 4, unrenderable_rows="error")
    with pytest.raises(DataError) as raised:
        tokenize_all([_conversation()], tool_tokenizer(), settings)
    message = str(raised.value)
    assert message.startswith("data row 1 (template error, data.unrenderable_rows: error): ")
    assert "tool turns are not supported" in message
    assert message.endswith(
        "; fix the row or the template (data.chat_template), or set data.unrenderable_rows: "
        "skip to leave such rows out (counted)"
    )
    skipping = attrs.evolve(settings, unrenderable_rows="skip")
    result = tokenize_all([_conversation()], tool_tokenizer(), skipping)
    assert [(line, kind) for line, kind, _ in result.skipped] == [(1, "template error")]
