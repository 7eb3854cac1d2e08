"""Training conversations, read without torch: OpenAI or ShareGPT rows -> messages.

A row is a list of turns (system, user, assistant, tool) as the OpenAI chat format has them: an
assistant turn may carry ``tool_calls`` (each a function name and JSON-object arguments, as a
JSON string or an object) and ``reasoning_content`` (``reasoning`` too); a tool turn may carry
``tool_call_id``; the row may carry ``tools`` (a list of JSON schemas, or that list as JSON text)
and ``tag`` (a workload name such as ``chat``, ``code`` or ``tool``, which `eval` reports tau
per). ShareGPT's ``tool``/``observation``/``function_response`` turns are tool turns and a
``function_call`` turn (its value a JSON object with ``name`` and ``arguments``) is an assistant
tool call. Nothing here renders a row: the target's chat template does
(:mod:`~dflash_recipes.executor.data.tokenize`), from :func:`template_messages`.

Reading never raises for a bad row: each is kept as a :class:`SkippedLine` (1-based line or row
number, a short kind, the reason) and summarised; only an input with no usable conversation is
a :class:`~dflash_recipes.errors.DataError`. The formats (JSONL, gzipped JSONL, Parquet, Arrow,
folders of them, `datasets` save_to_disk folders) are in :mod:`dflash_recipes.data.sources`.

This module imports neither torch nor transformers: `regenerate` against a server and `eval`'s
prompt reading use it; the executor tokenizes what it yields.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import attrs

from dflash_recipes.data.sources import (
    DATA_INT_DIGITS,
    DataSource,
    RawLine,
    iter_rows,
    resolve_source,
)
from dflash_recipes.errors import DataError
from dflash_recipes.files.jsonio import JsonProblem, parse_json, shorten
from dflash_recipes.records import Record

Role = Literal["system", "user", "assistant", "tool"]

_OPENAI_ROLES: dict[str, Role] = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_SHAREGPT_ROLES: dict[str, Role] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
    "function_call": "assistant",
}
#: The keys an assistant turn's thinking is read from, first found wins.
_REASONING_KEYS = ("reasoning_content", "reasoning")
#: How many per-line reasons a DataError message quotes.
_REASONS_SHOWN = 5
#: How many line numbers a summary lists per kind before "...".
_LINES_SHOWN = 10


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


@attrs.frozen(repr=False, eq=False, slots=False)
class ToolCall(Record):
    """One function call of an assistant turn."""

    name: str
    #: The arguments: JSON text of an object (as the OpenAI format sends them).
    arguments: str
    #: The call's id, which the tool turn answering it names (None: the row gave none).
    id: str | None = None


@attrs.frozen(repr=False, eq=False, slots=False)
class Message(Record):
    """One turn of a conversation, with the role normalised to system | user | assistant | tool."""

    role: Role
    content: str
    #: An assistant turn's function calls, in order.
    tool_calls: tuple[ToolCall, ...] = ()
    #: An assistant turn's thinking (`reasoning_content`), None when the row has none.
    reasoning: str | None = None
    #: A tool turn's answer to this call id (None: the row gave none).
    tool_call_id: str | None = None


@attrs.frozen(repr=False, eq=False, slots=False)
class Conversation(Record):
    """A usable conversation and the 1-based line it came from."""

    line: int
    messages: tuple[Message, ...]
    #: The row's `tools` (a list of JSON schemas) as JSON text, None when it has none.
    tools: str | None = None
    #: The row's workload `tag` (eval reports tau per tag), None when it has none.
    tag: str | None = None


def tool_schemas(tools: str | None) -> list[dict[str, object]] | None:
    """The `tools` argument of a chat template: the row's schemas, or None."""
    if tools is None:
        return None
    value = json.loads(tools)
    assert isinstance(value, list)
    return value


def template_messages(messages: Sequence[Message]) -> list[dict[str, object]]:
    """The messages as chat templates read them (Hugging Face's convention: a tool call's
    ``function.arguments`` is an object, the thinking is ``reasoning_content``)."""
    return [_message_dict(m, arguments_as_text=False) for m in messages]


def openai_messages(messages: Sequence[Message]) -> list[dict[str, object]]:
    """The messages in the OpenAI chat format (a tool call's arguments as JSON text): what a
    server is sent and what `regenerate` writes."""
    return [_message_dict(m, arguments_as_text=True) for m in messages]


def _message_dict(message: Message, *, arguments_as_text: bool) -> dict[str, object]:
    item: dict[str, object] = {"role": message.role, "content": message.content}
    if message.reasoning is not None:
        item["reasoning_content"] = message.reasoning
    if message.tool_calls:
        calls: list[dict[str, object]] = []
        for call in message.tool_calls:
            arguments: object = call.arguments if arguments_as_text else json.loads(call.arguments)
            entry: dict[str, object] = {
                "type": "function",
                "function": {"name": call.name, "arguments": arguments},
            }
            if call.id is not None:
                entry["id"] = call.id
            calls.append(entry)
        item["tool_calls"] = calls
    if message.tool_call_id is not None:
        item["tool_call_id"] = message.tool_call_id
    return item


@attrs.frozen(repr=False, eq=False, slots=False)
class SkippedLine(Record):
    """A line (or conversation) that was not used: where, what kind of problem, and why."""

    line: int
    #: Short category used to group the summary, e.g. "invalid JSON", "bad role".
    kind: str
    #: The full explanation for this line.
    reason: str


@attrs.frozen(repr=False, eq=False, slots=False)
class ConversationFile(Record):
    """The usable conversations of a JSONL file and the lines that were skipped."""

    path: Path
    conversations: tuple[Conversation, ...]
    skipped: tuple[SkippedLine, ...]

    @property
    def summary(self) -> str:
        """'used N conversations, skipped M: 3 invalid JSON (lines 4, 9, 12), ...'."""
        return summarize(len(self.conversations), self.skipped)


def summarize(used: int, skipped: Sequence[SkippedLine]) -> str:
    """One line: how many conversations were used, how many skipped, grouped by kind."""
    text = f"used {used} conversation{'' if used == 1 else 's'}, skipped {len(skipped)}"
    if not skipped:
        return text
    groups: dict[str, list[int]] = {}
    for item in skipped:
        groups.setdefault(item.kind, []).append(item.line)
    parts = []
    for kind, lines in groups.items():
        shown = ", ".join(str(n) for n in lines[:_LINES_SHOWN])
        if len(lines) > _LINES_SHOWN:
            shown += f", ... ({len(lines) - _LINES_SHOWN} more)"
        parts.append(f"{len(lines)} {kind} (line{'' if len(lines) == 1 else 's'} {shown})")
    return text + ": " + ", ".join(parts)


def quote_reasons(skipped: Sequence[SkippedLine]) -> str:
    lines = [f"  line {item.line}: {item.reason}" for item in skipped[:_REASONS_SHOWN]]
    if len(skipped) > _REASONS_SHOWN:
        lines.append(f"  ... and {len(skipped) - _REASONS_SHOWN} more")
    return "\n".join(lines)


def read_conversations(
    path: Path, *, answer_only_loss: bool = True, setting: str = "data.data_path"
) -> ConversationFile:
    """Read the OpenAI or ShareGPT conversations of an input (a file or folder; see sources).

    Blank JSONL lines are ignored. Every other row is either a usable :class:`Conversation` or
    a :class:`SkippedLine` saying what is wrong. With `answer_only_loss`, a conversation
    without an assistant turn has nothing to supervise and is skipped. Raises DataError when
    the input is missing, unreadable, empty, or has no usable conversation (quoting the first
    reasons); `setting` is what the user sets to point at another input (the recipe key or a
    command-line option). Holds every conversation in memory: training streams instead
    (:func:`iter_conversations`).
    """
    source = resolve_source(Path(path), setting=setting)
    conversations: list[Conversation] = []
    skipped: list[SkippedLine] = []
    for item in iter_conversations(source, answer_only_loss=answer_only_loss):
        if isinstance(item, Conversation):
            conversations.append(item)
        else:
            skipped.append(item)
    file = ConversationFile(source.path, tuple(conversations), tuple(skipped))
    if not conversations:
        raise no_usable_conversation(source.path, skipped)
    return file


def no_usable_conversation(path: Path, skipped: Sequence[SkippedLine]) -> DataError:
    """The DataError of an input without a usable conversation (empty, or every row skipped)."""
    if not skipped:
        return DataError(f"data file {path} is empty: no conversation to train on")
    msg = f"no usable conversation in {path} ({summarize(0, skipped)}):\n" + quote_reasons(skipped)
    return DataError(msg)


def iter_conversations(
    source: DataSource, *, answer_only_loss: bool
) -> Iterator[Conversation | SkippedLine]:
    """Each row of `source` in order: a usable conversation or why it was skipped (streamed)."""
    for number, row in iter_rows(source):
        item = conversation_of(number, row, answer_only_loss=answer_only_loss)
        if item is not None:
            yield item


def conversation_of(
    number: int, row: RawLine | dict[str, object], *, answer_only_loss: bool
) -> Conversation | SkippedLine | None:
    """One row of :func:`~dflash_recipes.data.sources.iter_rows` read: a usable conversation,
    why it is skipped, or None for a blank JSONL line (not counted)."""
    try:
        if isinstance(row, RawLine):
            if row.text is None:
                return SkippedLine(number, row.kind, row.error or "not valid UTF-8")
            if not row.text.strip():
                return None
            return _parse_line(number, row.text, answer_only_loss=answer_only_loss)
        return parse_conversation(number, row, answer_only_loss=answer_only_loss)
    except _LineProblem as problem:
        return SkippedLine(number, problem.kind, problem.reason)


class _LineProblem(Exception):
    """Why one row is unusable (caught by iter_conversations, never escapes)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def _parse_line(number: int, line: str, *, answer_only_loss: bool) -> Conversation:
    """The conversation of one line; _LineProblem says why it is unusable."""
    try:
        record = parse_json(line, max_int_digits=DATA_INT_DIGITS, allow_duplicate_keys=True)
    except JsonProblem as exc:
        raise _LineProblem("invalid JSON", exc.reason) from None
    if not isinstance(record, dict):
        raise _LineProblem("not an object", f"expected a JSON object, got {_json_type(record)}")
    return parse_conversation(number, record, answer_only_loss=answer_only_loss)


def parse_conversation(
    number: int, record: dict[str, object], *, answer_only_loss: bool
) -> Conversation:
    """One row (a JSON object or a Parquet/Arrow row) as a conversation, with its `tools` and
    `tag`; _LineProblem says why it is unusable."""
    messages = parse_record(record, answer_only_loss=answer_only_loss)
    return Conversation(number, messages, _tools_of(record), _tag_of(record))


def _tools_of(record: dict[str, object]) -> str | None:
    tools = record.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):  # ShareGPT sets (glaive, LLaMA-Factory) store the list as text
        if not tools.strip():
            return None
        try:
            tools = json.loads(tools)
        except ValueError:
            reason = f"'tools' is a string that is not JSON: {shorten(tools)}"
            raise _LineProblem("bad tools", reason) from None
    if not isinstance(tools, list):
        reason = f"'tools' must be a list of tool schemas (objects), got {_json_type(tools)}"
        raise _LineProblem("bad tools", reason)
    for index, schema in enumerate(tools):
        if not isinstance(schema, dict):
            reason = f"tools[{index}] must be a tool schema (an object), got {_json_type(schema)}"
            raise _LineProblem("bad tools", reason)
    if not tools:
        return None
    return json.dumps(tools, ensure_ascii=False)


def _tag_of(record: dict[str, object]) -> str | None:
    tag = record.get("tag")
    if tag is None:
        return None
    if not isinstance(tag, str) or not tag.strip():
        reason = f"'tag' must be a workload name (a non-empty string), got {shorten(tag)}"
        raise _LineProblem("bad tag", reason)
    return tag.strip()


def parse_record(record: dict[str, object], *, answer_only_loss: bool) -> tuple[Message, ...]:
    """The messages of one row (a JSON object or a Parquet/Arrow row); _LineProblem says why
    it is unusable. A `system` string column becomes the first message (unless one is there)."""
    if record.get("messages") is None and record.get("conversations") is not None:
        key, role_key, content_key, roles = "conversations", "from", "value", _SHAREGPT_ROLES
    elif "messages" in record:
        key, role_key, content_key, roles = "messages", "role", "content", _OPENAI_ROLES
    elif "conversations" in record:  # present but null
        key, role_key, content_key, roles = "conversations", "from", "value", _SHAREGPT_ROLES
    else:
        keys = ", ".join(sorted(record)) or "none"
        reason = (
            f"has neither a 'messages' (OpenAI) nor a 'conversations' (ShareGPT) key (keys: {keys})"
        )
        raise _LineProblem("no conversation key", reason)
    turns = record[key]
    if not isinstance(turns, list):
        raise _LineProblem("bad message list", f"'{key}' must be a list, got {_json_type(turns)}")
    if not turns:
        raise _LineProblem("empty conversation", f"'{key}' is an empty list")
    messages: list[Message] = []
    for index, turn in enumerate(turns):
        where = f"{key}[{index}]"
        if not isinstance(turn, dict):
            raise _LineProblem("bad message", f"{where} must be an object, got {_json_type(turn)}")
        if role_key not in turn:
            raise _LineProblem("bad role", f"{where} has no '{role_key}'")
        raw_role = turn[role_key]
        role = roles.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            reason = (
                f"{where} has {role_key} {shorten(raw_role)}; expected one of {', '.join(roles)}"
            )
            raise _LineProblem("bad role", reason)
        messages.append(_message_of(turn, role, where, role_key, content_key))
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        reason = f"'system' must be a string, got {_json_type(system)}"
        raise _LineProblem("non-string content", reason)
    if system and messages[0].role != "system":
        messages.insert(0, Message("system", system))
    if answer_only_loss and not any(m.role == "assistant" for m in messages):
        reason = "no assistant turn: nothing to supervise with data.answer_only_loss"
        raise _LineProblem("no assistant turn", reason)
    return tuple(messages)


def _message_of(
    turn: dict[str, object], role: Role, where: str, role_key: str, content_key: str
) -> Message:
    """One turn: its text, and an assistant's tool calls and thinking or a tool's call id."""
    if turn.get(role_key) == "function_call":  # ShareGPT: the value is the call itself
        call = _parse_json_object(turn.get(content_key), f"{where} '{content_key}'")
        return Message("assistant", "", (_tool_call(call, f"{where} '{content_key}'"),))
    calls: tuple[ToolCall, ...] = ()
    raw_calls = turn.get("tool_calls")
    if raw_calls is not None:
        if role != "assistant":
            reason = f"{where} is a {role} turn with 'tool_calls'; only assistant turns call tools"
            raise _LineProblem("bad tool call", reason)
        if not isinstance(raw_calls, list):
            reason = f"{where} 'tool_calls' must be a list, got {_json_type(raw_calls)}"
            raise _LineProblem("bad tool call", reason)
        calls = tuple(
            _tool_call(item, f"{where}.tool_calls[{index}]") for index, item in enumerate(raw_calls)
        )
    reasoning = None
    if role == "assistant":
        key = next((k for k in _REASONING_KEYS if turn.get(k) is not None), None)
        if key is not None:
            value = turn[key]
            if not isinstance(value, str):
                reason = f"{where} '{key}' must be a string, got {_json_type(value)}"
                raise _LineProblem("non-string content", reason)
            reasoning = value
    content = turn.get(content_key)
    if content is None and role == "assistant" and (calls or reasoning is not None):
        content = ""  # OpenAI: a turn that only calls tools has "content": null
    if not isinstance(content, str):
        shown = "missing" if content_key not in turn else _json_type(content)
        reason = f"{where} '{content_key}' must be a string, got {shown}"
        raise _LineProblem("non-string content", reason)
    call_id = turn.get("tool_call_id") if role == "tool" else None
    if call_id is not None and not isinstance(call_id, str):
        reason = f"{where} 'tool_call_id' must be a string, got {_json_type(call_id)}"
        raise _LineProblem("bad tool call", reason)
    return Message(role, content, calls, reasoning, call_id)


def _tool_call(item: object, where: str) -> ToolCall:
    """One entry of `tool_calls` (OpenAI's {"function": {...}} or a flat {"name", ...})."""
    if not isinstance(item, dict):
        reason = f"{where} must be an object, got {_json_type(item)}"
        raise _LineProblem("bad tool call", reason)
    function = item.get("function", item)
    if not isinstance(function, dict):
        reason = f"{where}.function must be an object, got {_json_type(function)}"
        raise _LineProblem("bad tool call", reason)
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        reason = f"{where} needs a function name (a non-empty string), got {shorten(name)}"
        raise _LineProblem("bad tool call", reason)
    raw = function.get("arguments", {})
    arguments = _parse_json_object(raw, f"{where} arguments")
    call_id = item.get("id")
    if call_id is not None and not isinstance(call_id, str):
        reason = f"{where}.id must be a string, got {_json_type(call_id)}"
        raise _LineProblem("bad tool call", reason)
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), call_id)


def _parse_json_object(value: object, where: str) -> dict[str, object]:
    """A JSON object given as an object or as its JSON text; _LineProblem otherwise."""
    if isinstance(value, str):
        try:
            value = parse_json(value, max_int_digits=DATA_INT_DIGITS, allow_duplicate_keys=True)
        except JsonProblem as exc:
            reason = f"{where} must be a JSON object, but the text is not JSON: {exc.reason}"
            raise _LineProblem("bad tool call", reason) from None
    if not isinstance(value, dict):
        reason = f"{where} must be a JSON object, got {_json_type(value)}"
        raise _LineProblem("bad tool call", reason)
    return value


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


__all__ = [
    "Conversation",
    "ConversationFile",
    "Message",
    "Role",
    "SkippedLine",
    "ToolCall",
    "conversation_of",
    "iter_conversations",
    "no_usable_conversation",
    "openai_messages",
    "parse_conversation",
    "parse_record",
    "quote_reasons",
    "read_conversations",
    "summarize",
    "template_messages",
    "tool_schemas",
]
