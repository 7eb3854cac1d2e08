"""Rows with tool calls, tool results, reasoning, `tools` and a workload `tag` (issue 52): read as
the OpenAI chat format (and ShareGPT's equivalents) has them; a malformed part is a counted
skip that names the row's part, and no row makes the reader raise (property test)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from testkit.fuzzing import FUZZ, json_values
from testkit.tool_chat import ANSWER, FINAL_REASONING, REASONING, TOOL_RESULT, tool_row

from dflash_recipes.data.conversations import (
    Conversation,
    Message,
    SkippedLine,
    ToolCall,
    conversation_of,
    openai_messages,
    template_messages,
    tool_schemas,
)


def _read(row: dict[str, Any]) -> Conversation | SkippedLine | None:
    return conversation_of(7, row, answer_only_loss=True)


def test_an_openai_tool_row_keeps_every_part() -> None:
    conversation = _read(tool_row(tag="tool"))
    assert isinstance(conversation, Conversation)
    roles = [m.role for m in conversation.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    call_turn, result, final = conversation.messages[2:]
    assert call_turn == Message(
        "assistant", "", (ToolCall("get_weather", '{"city": "Paris"}', "call_1"),), REASONING
    )
    assert result == Message("tool", TOOL_RESULT, tool_call_id="call_1")
    assert final == Message("assistant", ANSWER, reasoning=FINAL_REASONING)
    assert conversation.tag == "tool"
    schemas = tool_schemas(conversation.tools)
    assert schemas is not None and schemas[0]["function"]["name"] == "get_weather"  # type: ignore[index]


def test_templates_get_argument_objects_and_servers_get_argument_text() -> None:
    conversation = _read(tool_row())
    assert isinstance(conversation, Conversation)
    for_template = template_messages(conversation.messages)[2]
    for_server = openai_messages(conversation.messages)[2]
    call = for_template["tool_calls"][0]["function"]  # type: ignore[index]
    assert call["arguments"] == {"city": "Paris"}
    assert for_server["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # type: ignore[index]
    assert for_template["reasoning_content"] == REASONING
    assert template_messages(conversation.messages)[3]["tool_call_id"] == "call_1"


def test_arguments_given_as_an_object_and_a_flat_call_are_read() -> None:
    row = tool_row()
    row["messages"][2]["tool_calls"] = [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    conversation = _read(row)
    assert isinstance(conversation, Conversation)
    assert conversation.messages[2].tool_calls == (ToolCall("get_weather", '{"city": "Oslo"}'),)


def test_sharegpt_function_call_and_observation_turns() -> None:
    row = {
        "tools": json.dumps([{"name": "get_weather", "parameters": {}}]),
        "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {
                "from": "function_call",
                "value": '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
            },
            {"from": "observation", "value": "rain"},
            {"from": "gpt", "value": "It rains."},
        ],
    }
    conversation = _read(row)
    assert isinstance(conversation, Conversation)
    assert [m.role for m in conversation.messages] == ["user", "assistant", "tool", "assistant"]
    assert conversation.messages[1].tool_calls == (ToolCall("get_weather", '{"city": "Oslo"}'),)
    assert tool_schemas(conversation.tools) == [{"name": "get_weather", "parameters": {}}]


@pytest.mark.parametrize(
    ("edit", "kind", "reason"),
    [
        (
            lambda r: r["messages"][2]["tool_calls"][0]["function"].update(arguments="{city: 1"),
            "bad tool call",
            "messages[2].tool_calls[0] arguments must be a JSON object, but the text is not JSON",
        ),
        (
            lambda r: r["messages"][2]["tool_calls"][0]["function"].update(arguments="[1, 2]"),
            "bad tool call",
            "messages[2].tool_calls[0] arguments must be a JSON object, got a list",
        ),
        (
            lambda r: r["messages"][2]["tool_calls"][0]["function"].pop("name"),
            "bad tool call",
            "messages[2].tool_calls[0] needs a function name (a non-empty string), got None",
        ),
        (
            lambda r: r["messages"][2].update(tool_calls={"name": "x"}),
            "bad tool call",
            "messages[2] 'tool_calls' must be a list, got an object",
        ),
        (
            lambda r: r["messages"][1].update(tool_calls=[]),
            "bad tool call",
            "messages[1] is a user turn with 'tool_calls'; only assistant turns call tools",
        ),
        (
            lambda r: r["messages"][3].update(tool_call_id=3),
            "bad tool call",
            "messages[3] 'tool_call_id' must be a string, got a number",
        ),
        (
            lambda r: r["messages"][4].update(reasoning_content=["x"]),
            "non-string content",
            "messages[4] 'reasoning_content' must be a string, got a list",
        ),
        (
            lambda r: r["messages"][3].update(role="function"),
            "bad role",
            "messages[3] has role 'function'; expected one of system, user, assistant, tool",
        ),
        (lambda r: r.update(tools={"a": 1}), "bad tools", "'tools' must be a list"),
        (lambda r: r.update(tools=["x"]), "bad tools", "tools[0] must be a tool schema"),
        (lambda r: r.update(tools="[oops"), "bad tools", "'tools' is a string that is not JSON"),
        (lambda r: r.update(tag=3), "bad tag", "'tag' must be a workload name"),
    ],
)
def test_a_malformed_part_is_a_counted_skip_naming_it(edit: Any, kind: str, reason: str) -> None:
    row = tool_row()
    edit(row)
    skipped = _read(row)
    assert isinstance(skipped, SkippedLine)
    assert (skipped.line, skipped.kind) == (7, kind)
    assert reason in skipped.reason


def _turn() -> st.SearchStrategy[object]:
    call = st.fixed_dictionaries(
        {},
        optional={
            "id": json_values,
            "type": json_values,
            "function": json_values
            | st.fixed_dictionaries(
                {}, optional={"name": json_values | st.text(max_size=5), "arguments": json_values}
            ),
            "name": json_values,
            "arguments": json_values | st.text(max_size=20),
        },
    )
    return json_values | st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["system", "user", "assistant", "tool", "robot", ""])
            | json_values,
            "content": json_values | st.text(max_size=10),
            "tool_calls": json_values | st.lists(call | json_values, max_size=3),
            "tool_call_id": json_values,
            "reasoning_content": json_values | st.text(max_size=10),
            "reasoning": json_values,
        },
    )


rows = st.fixed_dictionaries(
    {"messages": st.lists(_turn(), max_size=5) | json_values},
    optional={"tools": json_values | st.text(max_size=10), "tag": json_values},
)


@FUZZ
@given(row=rows, answer_only_loss=st.booleans())
def test_no_row_makes_the_reader_raise(row: dict[str, object], answer_only_loss: bool) -> None:
    item = conversation_of(3, row, answer_only_loss=answer_only_loss)
    assert isinstance(item, (Conversation, SkippedLine))
    if isinstance(item, SkippedLine):
        assert item.line == 3 and item.kind and item.reason
        return
    # what was read renders as JSON both ways (for a template and for a server)
    json.dumps(template_messages(item.messages))
    json.dumps(openai_messages(item.messages))
    tool_schemas(item.tools)
