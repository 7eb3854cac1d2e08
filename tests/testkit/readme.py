"""The README's quoted console output, compared with what the code prints.

A quoted block is found by how it starts (the command, or the first line of the output);
:func:`assert_quoted_output` compares it with printed lines: the text word for word, and the
figures within :data:`FIGURE_TOLERANCE`, since the last digit of a float figure may differ
between machines with the same torch build (another CPU's kernels round differently).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
#: How far a quoted figure may be from the printed one: this much, or this share of it.
FIGURE_TOLERANCE = 0.05
FIGURE_SHARE = 0.03
#: A figure: a decimal number standing alone (not part of a word, a hex digest or "1..15").
_FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?=x\b|[^\w.]|\.?$)")


def quoted_block(start: str) -> list[str]:
    """The lines of the one fenced block of README.md that starts with `start`."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
    found = [block.splitlines() for block in blocks if block.startswith(start)]
    assert len(found) == 1, f"README.md has {len(found)} blocks starting {start!r}"
    return found[0]


def figures(line: str) -> tuple[str, list[float]]:
    """`line` with each figure replaced by `#`, and the figures."""
    values = [float(match) for match in _FIGURE.findall(line)]
    return _FIGURE.sub("#", line), values


def output_differences(quoted: Sequence[str], printed: Sequence[str]) -> list[str]:
    """Where `printed` is not what `quoted` says (empty when it is): a line of other text, or
    a figure further than the tolerance from the quoted one."""
    if len(quoted) != len(printed):
        return [f"{len(quoted)} lines quoted, {len(printed)} printed: {list(printed)}"]
    found = []
    for want, got in zip(quoted, printed, strict=True):
        want_text, want_values = figures(want)
        got_text, got_values = figures(got)
        close = all(
            abs(w - g) <= max(FIGURE_TOLERANCE, FIGURE_SHARE * abs(w))
            for w, g in zip(want_values, got_values, strict=True)
        )
        if want_text != got_text or not close:
            found.append(f"quoted {want!r}, printed {got!r}")
    return found


def assert_quoted_output(quoted: Sequence[str], printed: Sequence[str]) -> None:
    """Fail, naming each differing line and the fix, unless `printed` is what `quoted` says."""
    differences = output_differences(quoted, printed)
    assert not differences, (
        "README.md quotes other output than the code prints; paste the printed lines into "
        "README.md:\n" + "\n".join(differences)
    )


#: A figure the README cannot keep true: a count of installed packages or a duration (they
#: change with the dependencies' releases, pip's cache, the link and the machine's load).
_UNKEEPABLE = re.compile(
    r"\b\d+(?:\.\d+)? ?(?:packages|minutes?|min|hours?|h|seconds?|s)\b|\babout \d+\b|an hour",
    re.I,
)


def intro() -> str:
    """README.md before its first section: the install lines and what they cost."""
    return README.read_text(encoding="utf-8").split("\n## ", 1)[0]


def unkeepable_figures(text: str) -> list[str]:
    """Package counts and durations quoted in `text` (issue 49: "57 packages", "161 packages",
    "tests about 10" [minutes] drifted from what a fresh clone measured)."""
    return [match.group(0) for match in _UNKEEPABLE.finditer(text)]
