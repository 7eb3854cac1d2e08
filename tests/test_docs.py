"""docs/dflash.md keeps up with the code: its generated tables (diagnostic codes, recipe fields)
equal what `tools/gen_docs.py` renders now, and `--check` catches a stale copy."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import gen_docs
import pytest

import dflash_recipes
from dflash_recipes.diagnostics import CODE_MODULES, registered_codes
from dflash_recipes.recipe.json_schema import field_docs, recipe_json_schema

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "dflash.md"


REGENERATE = "regenerate with: python tools/gen_docs.py"


def docs_text() -> str:
    return DOCS.read_text(encoding="utf-8")


def import_compile_path() -> None:
    """Import every module outside the executor, whether or not its source says register_code.

    A module could register codes through a helper defined elsewhere; importing all of them
    makes the registry as complete as any user's process sees it.
    """
    for module in pkgutil.walk_packages(dflash_recipes.__path__, "dflash_recipes."):
        if module.name.startswith("dflash_recipes.executor") or module.name.endswith("__main__"):
            continue
        importlib.import_module(module.name)


def documented_codes() -> list[str]:
    region = gen_docs.generated_region(docs_text(), gen_docs.CODES_START, gen_docs.CODES_END)
    return re.findall(r"^\| `([a-z0-9-]+)` \|", region, flags=re.MULTILINE)


# ---------------------------------------------------------------------------------------------
# the committed docs
# ---------------------------------------------------------------------------------------------


def test_codes_table_equals_the_generated_one() -> None:
    region = gen_docs.generated_region(docs_text(), gen_docs.CODES_START, gen_docs.CODES_END)
    assert region == gen_docs.render_codes_table(), (
        f"docs/dflash.md codes table is stale; {REGENERATE}"
    )


def test_every_registered_code_is_documented_and_nothing_else() -> None:
    import_compile_path()
    gen_docs.render_codes_table()  # imports the modules the generator finds, too
    registered = {info.code for info in registered_codes()}
    documented = documented_codes()
    assert len(documented) == len(set(documented)), "a code is listed twice"
    missing = sorted(registered - set(documented))
    stale = sorted(set(documented) - registered)
    assert not missing, f"codes missing from docs/dflash.md: {missing}; {REGENERATE}"
    assert not stale, f"docs/dflash.md lists codes the code no longer has: {stale}"
    # the codes of every family are there (a registry that lost a module would shrink)
    for code in ("yaml-syntax", "unknown-key", "checkpoint-layout-mismatch", "output-unwritable"):
        assert code in documented


def test_one_call_makes_the_code_registry_complete(tmp_path: Path) -> None:
    # a fresh process that imports nothing but the registry sees every code the docs list
    script = (
        "from dflash_recipes.diagnostics import registered_codes\n"
        "print('\\n'.join(info.code for info in registered_codes()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert done.stdout.split() == sorted(documented_codes())
    # and every module that registers codes is one the registry imports
    assert set(gen_docs.code_modules()) <= set(CODE_MODULES)


def test_every_documented_code_has_its_registered_severity() -> None:
    import_compile_path()
    severities = {info.code: info.severity.value for info in registered_codes()}
    region = gen_docs.generated_region(docs_text(), gen_docs.CODES_START, gen_docs.CODES_END)
    for code, severity in re.findall(r"^\| `([a-z0-9-]+)` \| (\w+) \|", region, re.MULTILINE):
        assert severities[code] == severity, code


def test_fields_tables_equal_the_generated_ones() -> None:
    region = gen_docs.generated_region(docs_text(), gen_docs.FIELDS_START, gen_docs.FIELDS_END)
    assert region == gen_docs.render_fields_tables(), (
        f"docs/dflash.md field tables are stale; {REGENERATE}"
    )


def _leaf_paths(schema: dict[str, object], prefix: str = "") -> list[str]:
    paths = []
    properties = schema.get("properties")
    assert isinstance(properties, dict)
    for name, field in properties.items():
        if gen_docs.is_section_schema(field):  # target_server is an object or null
            paths += _leaf_paths(field, f"{prefix}{name}.")
        else:
            paths.append(f"{prefix}{name}")
    return paths


def test_every_recipe_field_has_a_comment_and_a_row_in_the_docs() -> None:
    docs = field_docs()
    region = gen_docs.generated_region(docs_text(), gen_docs.FIELDS_START, gen_docs.FIELDS_END)
    leaves = _leaf_paths(recipe_json_schema())
    assert "dflash.dflash_architecture_config.target_layer_ids" in leaves
    undocumented = [path for path in leaves if not docs.get(path)]
    assert not undocumented, f"recipe fields without a `#:` comment in recipe.py: {undocumented}"
    for path in leaves:
        section, _, name = path.rpartition(".")
        assert f"### `{section}`" in region, section
        assert f"| `{name}` |" in region, path


# ---------------------------------------------------------------------------------------------
# the generator's --check mode
# ---------------------------------------------------------------------------------------------


def test_check_passes_on_the_committed_docs_as_ci_runs_it() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_docs.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_check_fails_on_a_stale_copy_and_a_rewrite_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "dflash.md"
    text = docs_text()
    first_code = documented_codes()[0]
    stale.write_text(text.replace(f"| `{first_code}` |", "| `no-such-code` |"), encoding="utf-8")
    before = stale.read_text(encoding="utf-8")

    assert gen_docs.main(["--check", "--docs", str(stale)]) == 1
    assert "python tools/gen_docs.py" in capsys.readouterr().err
    assert stale.read_text(encoding="utf-8") == before, "--check must not write"

    assert gen_docs.main(["--docs", str(stale)]) == 0
    assert stale.read_text(encoding="utf-8") == text
    assert gen_docs.main(["--check", "--docs", str(stale)]) == 0


def test_a_missing_code_row_is_caught(tmp_path: Path) -> None:
    text = docs_text()
    row = next(line for line in text.splitlines() if line.startswith("| `taps-unknown` |"))
    stale = tmp_path / "dflash.md"
    stale.write_text(text.replace(row + "\n", ""), encoding="utf-8")
    assert gen_docs.main(["--check", "--docs", str(stale)]) == 1


def test_text_outside_the_markers_is_kept(tmp_path: Path) -> None:
    docs = tmp_path / "dflash.md"
    docs.write_text(
        "# Title\n\nprose before\n\n"
        "<!-- codes:start -->\nSTALE ROW\n<!-- codes:end -->\n\nbetween\n"
        "<!-- checkpoint-fields:start -->\n<!-- checkpoint-fields:end -->\n"
        "<!-- fields:start -->\n<!-- fields:end -->\nprose after\n"
        "<!-- known-layouts:start -->\n<!-- known-layouts:end -->\n"
        "<!-- architecture:start -->\n<!-- architecture:end -->\n",
        encoding="utf-8",
    )
    assert gen_docs.main(["--docs", str(docs)]) == 0
    text = docs.read_text(encoding="utf-8")
    assert "| `museglimmer-assistant` | `encoder.fc.weight` -> `fc.weight`<br>" in text
    assert "<!-- checkpoint-fields:start -->\n| config.json field | status |" in text
    assert text.startswith("# Title\n\nprose before\n\n<!-- codes:start -->\n| code |")
    assert "\n<!-- codes:end -->\n\nbetween\n<!-- checkpoint-fields:start -->" in text
    assert "<!-- checkpoint-fields:end -->\n<!-- fields:start -->\n### `model`" in text
    assert "<!-- fields:end -->\nprose after\n<!-- known-layouts:start -->" in text
    assert "| `compilation.py` | Compile a recipe into a frozen" in text
    assert "STALE ROW" not in text


def test_missing_markers_are_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = tmp_path / "dflash.md"
    docs.write_text("# no markers here\n", encoding="utf-8")
    assert gen_docs.main(["--check", "--docs", str(docs)]) == 2
    assert "codes:start" in capsys.readouterr().err
    assert docs.read_text(encoding="utf-8") == "# no markers here\n"


def test_pipes_in_a_meaning_cannot_break_the_table() -> None:
    for line in gen_docs.render_fields_tables().splitlines():
        if line.startswith("| `"):
            # 4 columns: 5 unescaped pipes
            assert len(re.findall(r"(?<!\\)\|", line)) == 5, line


def test_the_gamma_table_matches_the_compiler_default() -> None:
    from dflash_recipes.recipe.sections import default_loss_decay_factor

    lines = docs_text().splitlines()
    sizes_row = next(line for line in lines if line.startswith("| block size `B` |"))
    gamma_row = lines[lines.index(sizes_row) + 2]
    assert gamma_row.startswith("| gamma |")
    sizes = [int(cell) for cell in sizes_row.strip("|").split("|")[1:]]
    gammas = [float(cell.strip(" *")) for cell in gamma_row.strip("|").split("|")[1:]]
    assert len(sizes) == len(gammas) >= 3
    for size, gamma in zip(sizes, gammas, strict=True):
        assert round(default_loss_decay_factor(size), 2) == gamma, f"B={size}"
