"""Bounding what is echoed back to a user: values in messages, and whole messages.

Inputs are hostile or broken often enough (a 3 MB string in a config.json field, a path holding
a lone surrogate) that echoing them as they are turns a clean refusal into megabytes of output
or a UnicodeEncodeError. Two layers:

- :func:`shorten` (and :func:`clip` for paths) where a message is built: the value itself is cut
  to about :data:`ECHO_LIMIT` characters with the number left out, so the message keeps its shape;
- :func:`bound_message`, the one place every diagnostic (``Diagnostic.message`` and ``hint``)
  and every error message (``str(DFlashRecipeError)``, the CLI's ``error:`` lines) goes through:
  lone surrogates become ``\\udXXX`` escapes (printable and UTF-8 encodable on any stream), a line
  longer than :data:`LINE_LIMIT` and a message longer than :data:`MESSAGE_LIMIT` are cut in their
  middle, so a value a message builder forgot to shorten still cannot flood a terminal or a log.

Pure standard library, at the bottom of the layers (errors and diagnostics import it).
"""

from __future__ import annotations

#: Characters of a value echoed into a message before it is cut.
ECHO_LIMIT = 120
#: A line of a message longer than this is cut in its middle.
LINE_LIMIT = 2000
#: A whole message longer than this is cut in its middle.
MESSAGE_LIMIT = 20000


def shorten(value: object, limit: int = ECHO_LIMIT) -> str:
    """repr(value), cut to about `limit` characters with the number of characters left out."""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value) - limit} more characters)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    if isinstance(value, (bytes, bytearray)) and len(value) > limit:
        return repr(bytes(value[:limit])) + f"... ({len(value) - limit} more bytes)"
    text = repr(value)
    if len(text) > limit:
        return text[:limit] + f"... ({len(text) - limit} more characters)"
    return text


def clip(text: str, limit: int = 300) -> str:
    """`text` itself when short (paths read best unquoted), else cut with the count left out."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"... ({len(text) - limit} more characters)"


def printable(text: str) -> str:
    """`text` with lone surrogates written as ``\\udXXX`` escapes (encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 4, limit // 8
    left_out = len(text) - head - tail
    return f"{text[:head]} [... {left_out} characters left out ...] {text[-tail:]}"


def bound_message(text: str) -> str:
    """`text` printable (:func:`printable`) and bounded: each line cut to :data:`LINE_LIMIT`
    characters and the whole to :data:`MESSAGE_LIMIT`, in the middle (both ends kept: the fix
    is usually at the end)."""
    text = printable(text)
    if len(text) <= LINE_LIMIT:
        return text
    return _cut("\n".join(_cut(line, LINE_LIMIT) for line in text.split("\n")), MESSAGE_LIMIT)


__all__ = [
    "ECHO_LIMIT",
    "LINE_LIMIT",
    "MESSAGE_LIMIT",
    "bound_message",
    "clip",
    "printable",
    "shorten",
]
