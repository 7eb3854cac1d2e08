"""Training conversations, read without torch: OpenAI or ShareGPT rows -> messages.

Reading never raises for a bad row: each is kept as a :class:`SkippedLine` (1-based line or row
number, a short kind, the reason) and summarised; only an input with no usable conversation is
a :class:`~dflash_recipes.errors.DataError`. The formats (JSONL, gzipped JSONL, Parquet, Arrow,
folders of them, `datasets` save_to_disk folders) are in :mod:`dflash_recipes.data.sources`.

This module imports neither torch nor transformers: `regenerate` against a server and `eval`'s
prompt reading use it; the executor tokenizes what it yields.
"""

from __future__ import annotations

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

Role = Literal["system", "user", "assistant"]

_OPENAI_ROLES: dict[str, Role] = {"system": "system", "user": "user", "assistant": "assistant"}
_SHAREGPT_ROLES: dict[str, Role] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
#: How many per-line reasons a DataError message quotes.
_REASONS_SHOWN = 5
#: How many line numbers a summary lists per kind before "...".
_LINES_SHOWN = 10


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


@attrs.frozen(repr=False, eq=False, slots=False)
class Message(Record):
    """One turn of a conversation, with the role normalised to system | user | assistant."""

    role: Role
    content: str


@attrs.frozen(repr=False, eq=False, slots=False)
class Conversation(Record):
    """A usable conversation and the 1-based line it came from."""

    line: int
    messages: tuple[Message, ...]


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
            messages = _parse_line(row.text, answer_only_loss=answer_only_loss)
        else:
            messages = parse_record(row, answer_only_loss=answer_only_loss)
    except _LineProblem as problem:
        return SkippedLine(number, problem.kind, problem.reason)
    return Conversation(number, messages)


class _LineProblem(Exception):
    """Why one row is unusable (caught by iter_conversations, never escapes)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def _parse_line(line: str, *, answer_only_loss: bool) -> tuple[Message, ...]:
    """The messages of one line; _LineProblem says why it is unusable."""
    try:
        record = parse_json(line, max_int_digits=DATA_INT_DIGITS, allow_duplicate_keys=True)
    except JsonProblem as exc:
        raise _LineProblem("invalid JSON", exc.reason) from None
    if not isinstance(record, dict):
        raise _LineProblem("not an object", f"expected a JSON object, got {_json_type(record)}")
    return parse_record(record, answer_only_loss=answer_only_loss)


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
        content = turn.get(content_key)
        if not isinstance(content, str):
            shown = "missing" if content_key not in turn else _json_type(content)
            reason = f"{where} '{content_key}' must be a string, got {shown}"
            raise _LineProblem("non-string content", reason)
        messages.append(Message(role, content))
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
    "conversation_of",
    "iter_conversations",
    "no_usable_conversation",
    "parse_record",
    "quote_reasons",
    "read_conversations",
    "summarize",
]
