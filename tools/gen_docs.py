"""Regenerate the tables of docs/dflash.md from the code, so the docs cannot drift.

    python tools/gen_docs.py            # rewrite the generated regions in place
    python tools/gen_docs.py --check    # exit 1 if docs/dflash.md is out of date (CI, tests)

The regions generated are, each between its markers:

- `<!-- codes:start -->` .. `<!-- codes:end -->`: every diagnostic code, from
  `dflash_recipes.diagnostics.registered_codes()` (code | severity | meaning);
- `<!-- fields:start -->` .. `<!-- fields:end -->`: every recipe field, one table per section,
  with the `#:` comments of recipe.py (`dflash_recipes.recipe.json_schema.field_docs()`) and the
  types and
  defaults of the JSON Schema;
- `<!-- checkpoint-fields:start -->` .. `<!-- checkpoint-fields:end -->`: every checkpoint
  config.json field of the inventory `dflash_recipes.checkpoint.config_fields.CHECKPOINT_FIELDS`
  (field | status | what dflash-recipes does and why).

- `<!-- known-layouts:start -->` .. `<!-- known-layouts:end -->`: every checkpoint layout a warm
  start reads and its renames onto the z-lab names, from
  `dflash_recipes.checkpoint.known_layouts.KNOWN_LAYOUTS`.

- `<!-- architecture:start -->` .. `<!-- architecture:end -->`: the layers, top to bottom, from
  `dflash_recipes.layers.LAYERS` (the table `tests/test_architecture.py` enforces), then the
  package tree, one table per folder, each module with the first paragraph of its docstring
  (read with `ast`).

Text outside the markers is never touched.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "dflash_recipes"
DOCS = ROOT / "docs" / "dflash.md"
REGENERATE = "python tools/gen_docs.py"

CODES_START, CODES_END = "<!-- codes:start -->", "<!-- codes:end -->"
FIELDS_START, FIELDS_END = "<!-- fields:start -->", "<!-- fields:end -->"
INVENTORY_START = "<!-- checkpoint-fields:start -->"
INVENTORY_END = "<!-- checkpoint-fields:end -->"
ARCH_START, ARCH_END = "<!-- architecture:start -->", "<!-- architecture:end -->"
LAYOUTS_START, LAYOUTS_END = "<!-- known-layouts:start -->", "<!-- known-layouts:end -->"

JsonObject = Mapping[str, object]


class DocsError(Exception):
    """The docs file cannot be regenerated (missing or misplaced markers)."""


# ---------------------------------------------------------------------------------------------
# diagnostic codes
# ---------------------------------------------------------------------------------------------


def code_modules() -> list[str]:
    """Every module of the package whose source registers diagnostic codes.

    Found by their source, so a test can check that
    :data:`dflash_recipes.diagnostics.CODE_MODULES` (what makes the registry complete) names
    each of them.
    """
    modules = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.name in ("__main__.py", "diagnostics.py"):
            continue
        if "register_code" not in path.read_text("utf-8"):
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append(".".join(parts))
    return modules


def _cell(text: str) -> str:
    """Table-cell text: one line, and `|` escaped so it cannot split the cell."""
    return " ".join(text.split()).replace("|", "\\|")


def render_codes_table() -> str:
    """The markdown table of every registered diagnostic code, sorted by code."""
    from dflash_recipes.diagnostics import registered_codes

    lines = ["| code | severity | meaning |", "|---|---|---|"]
    lines += [
        f"| `{info.code}` | {info.severity.value} | {_cell(info.summary)} |"
        for info in registered_codes()
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# recipe fields
# ---------------------------------------------------------------------------------------------


def _type_text(schema: JsonObject) -> str:
    enum = schema.get("enum")
    if isinstance(enum, list):
        text = " \\| ".join(f"`{value}`" for value in enum if value is not None)
        return text + (" or null" if None in enum else "")
    kinds = schema.get("type")
    names = [kinds] if isinstance(kinds, str) else list(kinds) if isinstance(kinds, list) else []
    nullable = "null" in names
    words = []
    for kind in names:
        if kind == "null":
            continue
        if kind == "array":
            items = schema.get("items")
            inner = items.get("type") if isinstance(items, Mapping) else None
            words.append(f"list of {inner}s" if isinstance(inner, str) else "list")
        elif kind == "object":
            words.append("section")
        else:
            words.append(str(kind))
    return " or ".join(words) + (" or null" if nullable else "")


def _default_text(name: str, schema: JsonObject, required: object) -> str:
    if isinstance(required, list) and name in required:
        return "**required**"
    if is_section_schema(schema):
        return ""
    if "default" not in schema:
        return ""
    default = schema["default"]
    # Strings as a recipe writes them (no JSON quotes); everything else as JSON/YAML spells it.
    return f"`{default}`" if isinstance(default, str) else f"`{json.dumps(default)}`"


def is_section_schema(field: JsonObject) -> bool:
    """Whether a field's schema is a section: an object, or an object or null (target_server)."""
    kind = field.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _sections(
    schema: JsonObject, prefix: str = ""
) -> Iterator[tuple[str, list[tuple[str, JsonObject, object]]]]:
    """(dotted section path, [(field name, field schema, the section's required list)])."""
    properties = schema.get("properties")
    if not isinstance(properties, Mapping):
        return
    rows = []
    nested = []
    for name, field in properties.items():
        if not isinstance(field, Mapping):
            continue
        if is_section_schema(field):
            nested.append((f"{prefix}{name}", field))
        else:
            rows.append((name, field, schema.get("required")))
    if rows:
        yield prefix.rstrip("."), rows
    for path, field in nested:
        yield from _sections(field, f"{path}.")


def render_fields_tables() -> str:
    """One markdown table per recipe section: field | type | default | meaning."""
    from dflash_recipes.recipe.json_schema import field_docs, recipe_json_schema

    docs = field_docs()
    blocks = []
    for section, rows in _sections(recipe_json_schema()):
        about = docs.get(section, "")
        lines = [f"### `{section}`", ""]
        if about:
            lines += [about, ""]
        lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
        for name, field, required in rows:
            meaning = docs.get(f"{section}.{name}", "")
            lines.append(
                f"| `{name}` | {_type_text(field)} | {_default_text(name, field, required)} "
                f"| {_cell(meaning)} |"
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# ---------------------------------------------------------------------------------------------
# checkpoint config.json fields
# ---------------------------------------------------------------------------------------------


def render_checkpoint_fields_table() -> str:
    """The markdown table of the checkpoint field inventory, in the inventory's order."""
    from dflash_recipes.checkpoint.config_fields import CHECKPOINT_FIELDS

    lines = ["| config.json field | status | what dflash-recipes does, and why |", "|---|---|---|"]
    lines += [
        f"| `{field.key}` | {field.status} | {_cell(field.reason)} |" for field in CHECKPOINT_FIELDS
    ]
    return "\n".join(lines)


def render_known_layouts_table() -> str:
    """The markdown table of the known checkpoint layouts and their renames, in table order."""
    from dflash_recipes.checkpoint.known_layouts import KNOWN_LAYOUTS

    lines = ["| layout | stored as -> loaded as | what it is |", "|---|---|---|"]
    for layout in KNOWN_LAYOUTS:
        renames = [f"`{old}` -> `{new}`" for old, new in layout.renames.items()]
        renames += [f"`{layout.prefix}{name}.*` -> `{name}.*`" for name in layout.prefixed]
        shown = "<br>".join(renames) or "(the names as they are)"
        lines.append(f"| `{layout.name}` | {shown} | {_cell(layout.description)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the docs file
# ---------------------------------------------------------------------------------------------


def generated_region(text: str, start: str, end: str) -> str:
    """The text between the `start` and `end` markers (without the surrounding newlines)."""
    if text.count(start) != 1 or text.count(end) != 1:
        msg = f"expected exactly one {start} and one {end} marker"
        raise DocsError(msg)
    head, _, rest = text.partition(start)
    body, _, _ = rest.partition(end)
    if end in head:
        msg = f"{end} comes before {start}"
        raise DocsError(msg)
    return body.strip("\n")


def replace_region(text: str, start: str, end: str, content: str) -> str:
    """`text` with the region between the markers replaced by `content`."""
    generated_region(text, start, end)  # validates the markers
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    return f"{head}{start}\n{content}\n{end}{tail}"


# ---------------------------------------------------------------------------------------------
# architecture: the package tree from its docstrings
# ---------------------------------------------------------------------------------------------


def _first_paragraph(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line (read with ast, not imported)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def render_layers() -> str:
    """The layers table: each layer's rooms (folders or modules) and what they hold, top first."""
    from dflash_recipes.layers import LAYERS

    lines = ["| layer | rooms | what they hold |", "| --- | --- | --- |"]
    for number, layer in enumerate(LAYERS, start=1):
        rooms = ", ".join(f"`{_room_path(room)}`" for room in layer.rooms)
        lines.append(f"| {number} | {rooms} | {_cell(layer.holds)} |")
    return "\n".join(lines)


def _room_path(room: str) -> str:
    """A room as a path below the package: `cli/`, `lazy.py`, `recipe/choices.py`, `__init__.py`."""
    if not room:
        return "__init__.py"
    path = room.replace(".", "/")
    return f"{path}.py" if (PACKAGE_DIR / f"{path}.py").is_file() else f"{path}/"


def render_architecture() -> str:
    """The layers table, then one table per folder of the package: each module and the first
    paragraph of its docstring."""
    out: list[str] = [
        "A module imports its own room and the layers below it, never a layer above nor another "
        "room of its own layer (`dflash_recipes/layers.py`; `tests/test_architecture.py` checks "
        "every import):",
        "",
        render_layers(),
        "",
    ]
    folders = sorted(
        {p.parent for p in PACKAGE_DIR.rglob("*.py") if "remote_code" not in p.parts},
        key=lambda d: d.relative_to(ROOT).parts,
    )
    for folder in folders:
        rel = folder.relative_to(ROOT).as_posix()
        init = folder / "__init__.py"
        summary = _first_paragraph(init) if init.is_file() else ""
        out += [f"**`{rel}/`**: {summary}" if summary else f"**`{rel}/`**", ""]
        out += ["| module | what it holds |", "| --- | --- |"]
        for module in sorted(folder.glob("*.py")):
            if module.name != "__init__.py":
                out.append(f"| `{module.name}` | {_first_paragraph(module)} |")
        out.append("")
    return "\n".join(out).rstrip("\n")


def render_docs(text: str) -> str:
    """`text` (the docs file) with every generated region brought up to date."""
    text = replace_region(text, CODES_START, CODES_END, render_codes_table())
    text = replace_region(text, INVENTORY_START, INVENTORY_END, render_checkpoint_fields_table())
    text = replace_region(text, FIELDS_START, FIELDS_END, render_fields_tables())
    text = replace_region(text, LAYOUTS_START, LAYOUTS_END, render_known_layouts_table())
    return replace_region(text, ARCH_START, ARCH_END, render_architecture())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument("--docs", type=Path, default=DOCS, help="default: docs/dflash.md")
    args = parser.parse_args(argv)
    try:
        current = args.docs.read_text(encoding="utf-8")
        updated = render_docs(current)
    except (OSError, DocsError) as exc:
        print(f"error: {args.docs}: {exc}", file=sys.stderr)
        return 2
    if updated == current:
        print(f"{args.docs} is up to date")
        return 0
    if args.check:
        print(
            f"{args.docs} is out of date with the code (diagnostic codes, recipe fields "
            f"or checkpoint fields changed); regenerate it with: {REGENERATE}",
            file=sys.stderr,
        )
        return 1
    args.docs.write_text(updated, encoding="utf-8")
    print(f"rewrote the generated tables of {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
