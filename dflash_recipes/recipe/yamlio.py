"""Strict YAML loading that keeps a line/column mark for every dotted path.

Recipes are small hand-written files, so the loader is deliberately narrow:

- safe only (a `yaml.SafeLoader` subclass composes the node tree; values are built here);
- YAML 1.2 core scalars, stricter on booleans: only `true` and `false` are booleans, so
  `True`, `FALSE`, `yes`, `no`, `on` and `off` stay strings (a boolean field then reports the
  wrong type instead of guessing); `1e-4`, `1.0e-4` and `.5` are floats;
  `~`, `null` and an empty value are None; no timestamps, no sexagesimal or other implicit types;
- duplicate keys and keys that are not strings are errors (every one is reported);
- aliases are refused at the first `*name`, before anything is expanded, which makes alias
  bombs ("billion laughs") cost no more than reading the file; anchors alone are harmless;
- explicit tags other than the core ones (`!!str`, `!!int`, `!!float`, `!!bool`, `!!null`,
  `!!map`, `!!seq`) are errors.

Problems are raised as one :class:`~dflash_recipes.errors.RecipeError` carrying a diagnostic
per problem, each with a 1-based `line:column`.
"""

from __future__ import annotations

import math
import re
from typing import cast

import yaml

from dflash_recipes.diagnostics import Diagnostic, Severity, SourceMark, register_code
from dflash_recipes.errors import RecipeError

YAML_SYNTAX = register_code(
    "yaml-syntax",
    Severity.ERROR,
    "The recipe is not valid YAML (the position is where parsing failed).",
)
DUPLICATE_KEY = register_code(
    "duplicate-key",
    Severity.ERROR,
    "A key appears twice in the same mapping; YAML would silently keep one.",
)
YAML_ALIAS = register_code(
    "yaml-alias",
    Severity.ERROR,
    "YAML aliases (*name) and merge keys are not allowed in recipes (they enable alias bombs).",
)
NON_STRING_KEY = register_code(
    "non-string-key",
    Severity.ERROR,
    "A mapping key that is not a string (a number, boolean, null or list).",
)
YAML_TAG = register_code(
    "yaml-tag",
    Severity.ERROR,
    "An explicit YAML tag other than the core !!str/!!int/!!float/!!bool/!!null.",
)

_STR = "tag:yaml.org,2002:str"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_BOOL = "tag:yaml.org,2002:bool"
_NULL = "tag:yaml.org,2002:null"
_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"
_CORE_SCALAR_TAGS = frozenset({_STR, _INT, _FLOAT, _BOOL, _NULL})

_BOOL_RE = re.compile(r"^(?:true|false)$")
_NULL_RE = re.compile(r"^(?:~|null|Null|NULL|)$")
_INT_RE = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_RE = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)

#: Deeper nesting than this is refused (a recipe is four levels deep; this keeps recursion safe).
MAX_DEPTH = 64


class _AliasFound(Exception):
    """Raised while composing, at the first alias, so nothing is ever expanded."""

    def __init__(self, anchor: str, mark: yaml.Mark) -> None:
        super().__init__(anchor)
        self.anchor = anchor
        self.mark = mark


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core implicit types that refuses aliases while composing."""

    # A fresh table: the inherited YAML 1.1 resolvers (yes/no booleans, timestamps, `<<` merge
    # keys, sexagesimal ints) must not apply.
    yaml_implicit_resolvers = {}  # noqa: RUF012 (PyYAML's own class-level table)

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event: yaml.AliasEvent = self.peek_event()  # type: ignore[no-untyped-call]
            raise _AliasFound(str(event.anchor), cast(yaml.Mark, event.start_mark))
        return super().compose_node(parent, index)


_StrictLoader.add_implicit_resolver(_BOOL, _BOOL_RE, list("tf"))
_StrictLoader.add_implicit_resolver(_NULL, _NULL_RE, ["~", "n", "N", ""])
_StrictLoader.add_implicit_resolver(_INT, _INT_RE, list("-+0123456789"))
_StrictLoader.add_implicit_resolver(_FLOAT, _FLOAT_RE, list("-+.0123456789"))


def _mark(filename: str, mark: yaml.Mark) -> SourceMark:
    return SourceMark(file=filename, line=mark.line + 1, column=mark.column + 1)


def _where(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _scalar_from_tag(tag: str, text: str) -> tuple[bool, object]:
    """Build the Python value of a scalar whose tag is resolved; (False, None) if it cannot."""
    if tag == _STR:
        return True, text
    if tag == _NULL:
        return (True, None) if _NULL_RE.match(text) else (False, None)
    if tag == _BOOL:
        if not _BOOL_RE.match(text):
            return False, None
        return True, text == "true"
    if tag == _INT:
        if not _INT_RE.match(text):
            return False, None
        try:
            if text.startswith("0o"):
                return True, int(text[2:], 8)
            if text.startswith("0x"):
                return True, int(text[2:], 16)
            return True, int(text, 10)
        except ValueError:  # longer than Python's int-string limit (4300 digits)
            return False, None
    if tag == _FLOAT:
        if not _FLOAT_RE.match(text):
            return False, None
        lowered = text.lower()
        if lowered.endswith(".inf"):
            return True, -math.inf if lowered.startswith("-") else math.inf
        if lowered == ".nan":
            return True, math.nan
        return True, float(text)
    return False, None


class _Builder:
    """Turns a composed node tree into plain Python values, marks and diagnostics."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.marks: dict[str, SourceMark] = {}
        self.problems: list[Diagnostic] = []

    def problem(self, code: str, path: str, mark: yaml.Mark, message: str, hint: str) -> None:
        self.problems.append(
            Diagnostic(
                severity=Severity.ERROR,
                code=code,
                path=path,
                message=message,
                hint=hint,
                file=self.filename,
                line=mark.line + 1,
                column=mark.column + 1,
            )
        )

    def build(self, node: yaml.Node, path: str, depth: int = 0) -> object:
        if depth > MAX_DEPTH:
            self.problem(
                YAML_SYNTAX,
                path,
                node.start_mark,
                f"the YAML is nested more than {MAX_DEPTH} levels deep",
                "a recipe is at most four levels deep; check the indentation and brackets",
            )
            return None
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, depth)
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ:
                self._bad_tag(node, path)
            items: list[object] = []
            for index, item in enumerate(node.value):
                item_path = f"{path}.{index}" if path else str(index)
                self.marks[item_path] = _mark(self.filename, item.start_mark)
                items.append(self.build(item, item_path, depth + 1))
            return items
        assert isinstance(node, yaml.ScalarNode)
        ok, value = _scalar_from_tag(node.tag, node.value)
        if not ok:
            self._bad_tag(node, path)
        return value

    def _bad_tag(self, node: yaml.Node, path: str) -> None:
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        if node.tag in _CORE_SCALAR_TAGS and isinstance(node, yaml.ScalarNode):
            shown = node.value if len(node.value) <= 40 else node.value[:37] + "..."
            message = f"{shown!r} cannot be read as {tag}"
        else:
            message = f"unsupported YAML tag {tag} (recipes use plain values only)"
        self.problem(
            YAML_TAG,
            path,
            node.start_mark,
            message,
            "remove the tag; write a plain string, number, boolean, list or mapping",
        )

    def _mapping(self, node: yaml.MappingNode, path: str, depth: int) -> dict[str, object]:
        if node.tag != _MAP:
            self._bad_tag(node, path)
        result: dict[str, object] = {}
        first_seen: dict[str, yaml.Mark] = {}
        for key_node, value_node in node.value:
            key = self._key(key_node, path)
            if key is None:
                continue
            child = f"{path}.{key}" if path else key
            earlier = first_seen.get(key)
            if earlier is not None:
                self.problem(
                    DUPLICATE_KEY,
                    child,
                    key_node.start_mark,
                    f"duplicate key {key!r}: first at {_where(earlier)}, "
                    f"again at {_where(key_node.start_mark)}",
                    f"keep one {key!r} entry in this mapping and delete the other",
                )
                continue
            first_seen[key] = key_node.start_mark
            self.marks[child] = _mark(self.filename, key_node.start_mark)
            result[key] = self.build(value_node, child, depth + 1)
        return result

    def _key(self, key_node: yaml.Node, path: str) -> str | None:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag == _STR:
            return str(key_node.value)
        if isinstance(key_node, yaml.ScalarNode):
            shown = key_node.value if key_node.value else "null"
            what = f"the key {shown!r} is read as {_tag_word(key_node.tag)}, not a string"
        else:
            what = "a list or mapping is used as a key"
        where = f" in {path}" if path else ""
        self.problem(
            NON_STRING_KEY,
            path,
            key_node.start_mark,
            f"mapping keys must be strings{where}: {what}",
            "recipe keys are field names such as dflash_block_size; quote a key to make it text",
        )
        return None


def _tag_word(tag: str) -> str:
    words = {_INT: "an integer", _FLOAT: "a number", _BOOL: "a boolean", _NULL: "null"}
    return words.get(tag, tag)


def _syntax_diagnostic(error: yaml.YAMLError, text: str, filename: str) -> Diagnostic:
    hint = (
        "check the indentation (spaces, not tabs) and the brackets near this position; "
        "quote values that contain ': ' or ' #'"
    )
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        message = str(error.problem or "invalid YAML")
        if message == "but found another document":
            message = "a recipe is one YAML document, but a second document starts here"
            hint = "remove this `---` and everything after it, or move it to its own file"
        elif error.context and error.context_mark is not None:
            message += f" ({error.context} at {_where(error.context_mark)})"
        return Diagnostic(
            severity=Severity.ERROR,
            code=YAML_SYNTAX,
            path="",
            message=message,
            hint=hint,
            file=filename,
            line=mark.line + 1,
            column=mark.column + 1,
        )
    if isinstance(error, yaml.reader.ReaderError):
        before = text[: error.position]
        line = before.count("\n") + 1
        column = error.position - (before.rfind("\n") + 1) + 1
        raw = error.character
        code_point = raw if isinstance(raw, int) else ord(str(raw)[:1] or "?")
        return Diagnostic(
            severity=Severity.ERROR,
            code=YAML_SYNTAX,
            path="",
            message=f"character U+{code_point:04X} is not allowed in YAML",
            hint="remove the control character (often pasted from a terminal or a PDF)",
            file=filename,
            line=line,
            column=column,
        )
    return Diagnostic(
        severity=Severity.ERROR,
        code=YAML_SYNTAX,
        path="",
        message=str(error),
        hint=hint,
        file=filename,
    )


def load_yaml(text: str, *, filename: str) -> tuple[object, dict[str, SourceMark]]:
    """Parse one YAML document into plain data and a mark for every dotted path.

    Returns `(data, marks)`: data is built from dict/list/str/int/float/bool/None only (None for
    an empty document); marks map `section.key` and `section.list.0` to the 1-based position of
    the key (or list item). Raises :class:`RecipeError` with one diagnostic per problem.
    """
    try:
        loader = _StrictLoader(text)
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except _AliasFound as alias:
        diagnostic = Diagnostic(
            severity=Severity.ERROR,
            code=YAML_ALIAS,
            path="",
            message=f"YAML alias *{alias.anchor} is not allowed in a recipe",
            hint="write the value out in full (aliases, anchors with references and `<<` merges "
            "are refused so that a recipe can never expand into a huge document)",
            file=filename,
            line=alias.mark.line + 1,
            column=alias.mark.column + 1,
        )
        raise RecipeError(f"{filename}: YAML aliases are not allowed", [diagnostic]) from None
    except yaml.YAMLError as error:
        diagnostic = _syntax_diagnostic(error, text, filename)
        raise RecipeError(f"{filename}: invalid YAML", [diagnostic]) from None
    except RecursionError:
        diagnostic = Diagnostic(
            severity=Severity.ERROR,
            code=YAML_SYNTAX,
            path="",
            message="the YAML is nested too deeply to read",
            hint="a recipe is at most four levels deep; check the brackets",
            file=filename,
        )
        raise RecipeError(f"{filename}: invalid YAML", [diagnostic]) from None

    if root is None:
        return None, {}
    builder = _Builder(filename)
    data = builder.build(root, "")
    if builder.problems:
        count = len(builder.problems)
        msg = f"{filename}: {count} YAML problem{'s' if count != 1 else ''}"
        raise RecipeError(msg, builder.problems)
    return data, builder.marks


__all__ = ["MAX_DEPTH", "load_yaml"]
