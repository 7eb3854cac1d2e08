"""Diagnostics: what every check produces, and the renderers that present them.

Checks never print. They return :class:`Diagnostic` values; the CLI picks a renderer
(text, JSON or GitHub workflow commands). Every diagnostic code is registered once with
:func:`register_code`, so the documentation table is generated from the code itself.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Iterable, Mapping, Sequence

import attrs

from dflash_recipes.echo import bound_message
from dflash_recipes.records import Record


class Severity(enum.StrEnum):
    """How bad a finding is: errors stop compilation, warnings and infos do not."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@attrs.frozen(repr=False, eq=False, slots=False)
class CodeInfo(Record):
    """A registered diagnostic code and what it means for the user."""

    code: str
    severity: Severity
    summary: str


_CODES: dict[str, CodeInfo] = {}


def register_code(code: str, severity: Severity, summary: str) -> str:
    """Register a diagnostic code (once, at import time) and return it.

    Registering the same code twice with different meanings is a programming error.
    """
    info = CodeInfo(code=code, severity=severity, summary=summary)
    existing = _CODES.get(code)
    if existing is not None and existing != info:
        msg = f"diagnostic code {code!r} registered twice with different meanings"
        raise ValueError(msg)
    _CODES[code] = info
    return code


#: Every module that registers codes (at import). :func:`registered_codes` imports them all,
#: so the registry is complete after that one call; a test keeps this list whole.
CODE_MODULES: tuple[str, ...] = (
    "dflash_recipes.recipe.yamlio",
    "dflash_recipes.recipe.converter",
    "dflash_recipes.recipe.loader",
    "dflash_recipes.checkpoint.hfconfig",
    "dflash_recipes.compiler.field_checks",
    "dflash_recipes.compiler.capture_checks",
    "dflash_recipes.plan.regenerate_settings",
    "dflash_recipes.compiler.server_checks",
    "dflash_recipes.compiler.codes",
    "dflash_recipes.compiler.input_checks",
    "dflash_recipes.cli.group",
)


def registered_codes() -> tuple[CodeInfo, ...]:
    """Every diagnostic code of the package, sorted by code (imports :data:`CODE_MODULES`)."""
    for module in CODE_MODULES:
        importlib.import_module(module)
    return tuple(sorted(_CODES.values(), key=lambda c: c.code))


def code_severity(code: str) -> Severity:
    """The severity `code` was registered with (the one table of severities)."""
    info = _CODES.get(code)
    if info is None:
        msg = f"diagnostic code {code!r} is not registered"
        raise KeyError(msg)
    return info.severity


@attrs.frozen(repr=False, eq=False, slots=False)
class Diagnostic(Record):
    """One finding: severity, code, where (dotted path and source mark), what, and the fix.

    `message` and `hint` pass through :func:`~dflash_recipes.echo.bound_message` when made:
    printable, and bounded however large a value a check echoed into them.
    """

    severity: Severity
    code: str
    path: str
    message: str = attrs.field(converter=bound_message)
    hint: str | None = attrs.field(default=None, converter=attrs.converters.optional(bound_message))
    file: str | None = None
    line: int | None = None
    column: int | None = None

    @property
    def location(self) -> str:
        """`file:line:col` when known, else the file, else an empty string."""
        if self.file is None:
            return ""
        if self.line is None:
            return self.file
        if self.column is None:
            return f"{self.file}:{self.line}"
        return f"{self.file}:{self.line}:{self.column}"

    def to_json(self) -> dict[str, str | int | None]:
        """The JSON object of the `--format json` output."""
        return {
            "severity": self.severity.value,
            "code": self.code,
            "path": self.path,
            "message": self.message,
            "hint": self.hint,
            "file": self.file,
            "line": self.line,
            "column": self.column,
        }


@attrs.frozen(repr=False, eq=False, slots=False)
class SourceMark(Record):
    """Where a value came from: a file position (1-based line and column) or `<override N>`."""

    file: str
    line: int | None = None
    column: int | None = None


@attrs.frozen(repr=False, eq=False, slots=False)
class SourceMap(Record):
    """Marks of a loaded recipe, keyed by dotted path (`dflash.dflash_block_size`).

    Checks that only know a dotted path use :meth:`locate` to attach a file position; a path
    without its own mark gets the mark of its nearest marked ancestor (the section key).
    """

    file: str | None = None
    marks: Mapping[str, SourceMark] = attrs.field(factory=dict)

    def locate(self, path: str) -> SourceMark | None:
        """The mark of `path` or of its nearest marked ancestor; None when nothing is known."""
        probe = path
        while probe:
            mark = self.marks.get(probe)
            if mark is not None:
                return mark
            probe = probe.rpartition(".")[0]
        if self.file is not None:
            return SourceMark(file=self.file)
        return None

    def diagnostic(
        self,
        severity: Severity,
        code: str,
        path: str,
        message: str,
        hint: str | None = None,
    ) -> Diagnostic:
        """Build a diagnostic for `path`, located through this map."""
        mark = self.locate(path)
        return Diagnostic(
            severity=severity,
            code=code,
            path=path,
            message=message,
            hint=hint,
            file=mark.file if mark else None,
            line=mark.line if mark else None,
            column=mark.column if mark else None,
        )


def has_errors(diagnostics: Iterable[Diagnostic]) -> bool:
    """True when any diagnostic is an error."""
    return any(d.severity is Severity.ERROR for d in diagnostics)


def sort_diagnostics(diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Stable order for output: by file, line, column, then path (unknown positions last)."""
    big = 1 << 62

    def key(d: Diagnostic) -> tuple[str, int, int, str, str]:
        return (d.file or "", d.line or big, d.column or big, d.path, d.code)

    return sorted(diagnostics, key=key)


def render_one(d: Diagnostic) -> str:
    """`file:line:col: severity[code] path: message` plus an indented `fix:` line."""
    where = d.location
    head = f"{where}: " if where else ""
    path = f"{d.path}: " if d.path else ""
    text = f"{head}{d.severity.value}[{d.code}] {path}{d.message}"
    if d.hint:
        hint_lines = d.hint.splitlines() or [d.hint]
        text += "\n  fix: " + "\n       ".join(hint_lines)
    return text


def render_text(diagnostics: Sequence[Diagnostic]) -> str:
    """Human-readable multi-line report."""
    return "\n".join(render_one(d) for d in diagnostics)


def summary_line(diagnostics: Sequence[Diagnostic]) -> str:
    """`2 errors, 1 warning, 0 infos`."""
    counts = {s: 0 for s in Severity}
    for d in diagnostics:
        counts[d.severity] += 1

    def plural(n: int, word: str) -> str:
        return f"{n} {word}" + ("" if n == 1 else "s")

    return ", ".join(
        [
            plural(counts[Severity.ERROR], "error"),
            plural(counts[Severity.WARNING], "warning"),
            plural(counts[Severity.INFO], "info"),
        ]
    )


def _escape_data(value: str) -> str:
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(value: str) -> str:
    return _escape_data(value).replace(":", "%3A").replace(",", "%2C")


def render_github(diagnostics: Sequence[Diagnostic]) -> str:
    """GitHub Actions workflow commands (`::error file=..,line=..,col=..::msg`), escaped."""
    kinds = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}
    lines = []
    for d in diagnostics:
        props = []
        if d.file is not None:
            props.append(f"file={_escape_property(d.file)}")
        if d.line is not None:
            props.append(f"line={d.line}")
        if d.column is not None:
            props.append(f"col={d.column}")
        props.append(f"title={_escape_property(d.code)}")
        body = f"{d.path}: {d.message}" if d.path else d.message
        if d.hint:
            body += f"\nfix: {d.hint}"
        lines.append(f"::{kinds[d.severity]} {','.join(props)}::{_escape_data(body)}")
    return "\n".join(lines)


__all__ = [
    "CODE_MODULES",
    "CodeInfo",
    "Diagnostic",
    "Severity",
    "SourceMap",
    "SourceMark",
    "code_severity",
    "has_errors",
    "register_code",
    "registered_codes",
    "render_github",
    "render_one",
    "render_text",
    "sort_diagnostics",
    "summary_line",
]
