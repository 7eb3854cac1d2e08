"""Prompt files for ``dflash-recipe eval``: chat JSONL, a JSON list, or a Parquet column.

The format follows the file's suffix:

- ``.jsonl``: conversations in the training data's formats (OpenAI ``messages`` or ShareGPT
  ``conversations``, one per line;
  :func:`~dflash_recipes.data.conversations.read_conversations`);
- ``.json``: a list whose items are prompt strings or message lists (``[{"role": "user",
  "content": ...}, ...]``, ShareGPT ``from``/``value`` turns too), the shape of z-lab's
  ``bench_prompts.json``;
- ``.parquet``: one column (``--prompt-column``; by default the first of
  :data:`DEFAULT_COLUMNS` the file has) of strings or message lists, as Hugging Face
  ``datasets`` writes them (needs ``pyarrow``: ``pip install 'dflash-recipes[parquet]'``).

Every item becomes a :class:`~dflash_recipes.data.conversations.Conversation`
numbered from 1 (the line, item or row); a string is one user turn. The eval prompt is the
conversation before its first assistant turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dflash_recipes.data.conversations import Conversation, Message, Role
from dflash_recipes.data.sources import describe_columns
from dflash_recipes.errors import DataError
from dflash_recipes.files.jsonio import (
    FileReadProblem,
    JsonProblem,
    clip,
    parse_json,
    read_regular_file,
    regular_file_problem,
    shorten,
)

#: Columns a Parquet prompt file is read from when ``--prompt-column`` is not given, in order.
DEFAULT_COLUMNS = ("prompt", "messages", "conversations", "question", "problem", "turns")

_ROLES: dict[str, Role] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
}

#: The largest JSON prompt file read (z-lab's bench_prompts.json is a few hundred kB).
MAX_JSON_BYTES = 256 * 2**20

#: The unit a prompt's number counts, per format (for messages: "item 3", "row 7").
UNITS = {"jsonl": "line", "json": "item", "parquet": "row", "rows": "row"}


def prompt_format(path: Path) -> str:
    """``jsonl``, ``json`` or ``parquet`` from the suffix, ``rows`` for the other training-data
    inputs (a folder, ``.arrow``, ``.jsonl.gz``: read as conversations); DataError otherwise."""
    suffix = path.suffix.lower()
    if path.is_dir() or suffix in (".arrow", ".gz"):  # a folder named x.json is still a folder
        return "rows"
    if suffix in (".jsonl", ".json", ".parquet"):
        return suffix[1:]
    msg = (
        f"prompt file {path}: cannot tell its format from the suffix {suffix or '(none)'!r}; "
        "use .jsonl (chat conversations), .json (a list of prompt strings or message lists) "
        "or .parquet (a column of them, --prompt-column); a folder, .arrow or .jsonl.gz is "
        "read as training conversations"
    )
    raise DataError(msg)


def _check_readable(path: Path) -> None:
    problem = regular_file_problem(path)
    if problem is not None:
        what = "does not exist" if problem.missing else f"cannot be read: {problem.reason}"
        msg = f"prompt file {path} {what}"
        raise DataError(msg)


def conversation_from_value(value: object, number: int, where: str) -> Conversation:
    """A prompt string or a message list as a conversation; DataError naming ``where``."""
    if isinstance(value, str):
        if not value:
            msg = f"{where} is an empty string"
            raise DataError(msg)
        return Conversation(number, (Message("user", value),))
    if not isinstance(value, list) or not value:
        msg = (
            f"{where} must be a prompt string or a non-empty list of messages, got {shorten(value)}"
        )
        raise DataError(msg)
    messages: list[Message] = []
    for index, turn in enumerate(value):
        if not isinstance(turn, dict):
            msg = f"{where}[{index}] must be a message object, got {shorten(turn)}"
            raise DataError(msg)
        role_key, content_key = ("role", "content") if "role" in turn else ("from", "value")
        raw_role = turn.get(role_key)
        role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
        content = turn.get(content_key)
        if role is None or not isinstance(content, str):
            msg = (
                f"{where}[{index}] needs a role (system, user, assistant) and string content "
                f"('role'/'content' or 'from'/'value'), got {shorten(turn)}"
            )
            raise DataError(msg)
        messages.append(Message(role, content))
    return Conversation(number, tuple(messages))


def read_json_prompts(path: Path) -> list[Conversation]:
    """The items of a JSON list of prompt strings or message lists (at most
    :data:`MAX_JSON_BYTES`; JSON too deep, NaN or not UTF-8 is a DataError)."""
    _check_readable(path)
    try:
        data = parse_json(read_regular_file(path, max_bytes=MAX_JSON_BYTES))
    except (FileReadProblem, JsonProblem) as exc:
        msg = f"prompt file {path} is not readable JSON: {exc.reason}"
        raise DataError(msg) from None
    if not isinstance(data, list) or not data:
        msg = (
            f"prompt file {path} must hold a non-empty JSON list of prompt strings or message "
            f"lists, got {shorten(data)}"
        )
        raise DataError(msg)
    return [
        conversation_from_value(item, number, f"{path} item {number}")
        for number, item in enumerate(data, start=1)
    ]


def read_parquet_prompts(path: Path, column: str | None = None) -> list[Conversation]:
    """The values of one column of a Parquet file (strings or message lists)."""
    _check_readable(path)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        msg = (
            f"reading the Parquet prompt file {path} needs pyarrow: "
            "pip install 'dflash-recipes[parquet]'"
        )
        raise DataError(msg) from None
    try:
        parquet = pq.ParquetFile(path)
        names: Sequence[str] = parquet.schema_arrow.names
    except Exception as exc:  # pyarrow raises several kinds for a damaged file
        msg = f"prompt file {path} is not a readable Parquet file: {clip(str(exc))}"
        raise DataError(msg) from None
    chosen = (
        column if column is not None else next((c for c in DEFAULT_COLUMNS if c in names), None)
    )
    if chosen is None or chosen not in names:
        wanted = (
            f"column {shorten(column)}"
            if column is not None
            else "any of " + ", ".join(DEFAULT_COLUMNS)
        )
        msg = (
            f"prompt file {path} has no {wanted}; its columns are "
            f"{describe_columns(tuple(names))}: pass --prompt-column NAME"
        )
        raise DataError(msg)
    try:
        values = parquet.read(columns=[chosen]).column(chosen).to_pylist()
    except Exception as exc:  # a damaged row group is found only when it is read
        msg = f"prompt file {path} is not a readable Parquet file: {clip(str(exc))}"
        raise DataError(msg) from None
    if not values:
        msg = f"prompt file {path} has no rows"
        raise DataError(msg)
    return [
        conversation_from_value(value, number, f"{path} row {number} column {chosen!r}")
        for number, value in enumerate(values, start=1)
    ]


__all__ = [
    "DEFAULT_COLUMNS",
    "UNITS",
    "conversation_from_value",
    "prompt_format",
    "read_json_prompts",
    "read_parquet_prompts",
]
