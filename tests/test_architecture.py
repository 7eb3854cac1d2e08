"""The package's shape: layers that only look down, no import circles, folder sizes, module
lengths, tests that mirror it.

These are the properties a newcomer relies on to find a concern in one obvious place
(docs/dflash.md, "Architecture"); each test names the module that breaks the rule. The layers
are written down once, in :data:`dflash_recipes.layers.LAYERS` (the docs print the same table).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_recipes.layers import LAYERS, may_import, room_of

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash_recipes"
MAX_MODULES_PER_FOLDER = 12
MAX_MODULE_LINES = 700


def _modules() -> Iterator[Path]:
    yield from sorted(p for p in PACKAGE.rglob("*.py") if "remote_code" not in p.parts)


def _dotted(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, known: set[str], *, type_only: bool = False) -> set[str]:
    """Every project module `path` imports, at the top or inside functions; those under
    ``if TYPE_CHECKING:`` only with `type_only` (a type-only import is still a dependency)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {name for name in found if name in known}


def import_graph(*, type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (with `type_only`: TYPE_CHECKING ones too)."""
    paths = {_dotted(p): p for p in _modules()}
    known = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges = _imports(path, known, type_only=type_only) - {name}
        # importing `a.b.c` runs `a/__init__` and `a.b/__init__`: those are edges too, but a
        # package's own modules importing their package is not a circle worth naming
        graph[name] = {e for e in edges if not name.startswith(e + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


#: THE allowlist: imports the rules below accept for now, each with the reason and the change
#: that removes it (empty: every rule holds without exception). Every rule skips these edges and
#: nothing else; an entry whose import is gone fails `test_every_allowed_import_still_exists`,
#: so the list cannot outlive its reason.
KNOWN_BACKWARD_IMPORTS: dict[tuple[str, str], str] = {}


@functools.cache
def _checked_graph() -> dict[str, set[str]]:
    """The import graph the rules check: type-only imports included, allowlisted edges out."""
    graph = import_graph(type_only=True)
    return {a: {b for b in bs if (a, b) not in KNOWN_BACKWARD_IMPORTS} for a, bs in graph.items()}


def _room(module: str) -> str:
    return room_of(module.removeprefix("dflash_recipes").removeprefix("."))


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`importer -> imported (room -> room)` for each import of a module from a higher layer
    or from another room of its own layer."""
    return [
        f"{a} -> {b} ({_room(a) or 'dflash_recipes'} -> {_room(b)})"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if not may_import(_room(a), _room(b))
    ]


def test_no_import_circle_between_modules() -> None:
    # type-only imports count here too: a circle through TYPE_CHECKING still means a definition
    # lives in the wrong module
    cycle = find_cycle(_checked_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def _folder_of(module: str) -> str:
    """The folder a module's file lies in, dotted (a package's __init__ lies in its own)."""
    path = ROOT / Path(*module.split("."))
    return module if path.is_dir() else module.rpartition(".")[0]


@pytest.mark.parametrize("folder", sorted({_folder_of(_dotted(p)) for p in _modules()}))
def test_no_import_circle_inside_a_folder(folder: str) -> None:
    # run_plan -> value_checks -> (TYPE_CHECKING) run_plan was one, inside plan/
    graph = _checked_graph()
    inside = {a: {b for b in bs if _folder_of(b) == folder} for a, bs in graph.items()}
    cycle = find_cycle({a: bs for a, bs in inside.items() if _folder_of(a) == folder})
    assert cycle is None, f"import circle inside {folder}: " + " -> ".join(cycle or [])


def test_no_module_imports_from_a_higher_layer() -> None:
    # dflash_recipes/layers.py: a module imports its own room and the layers below it only
    found = backward_imports(_checked_graph())
    assert found == [], "imports from a higher layer (or a neighbour room):\n" + "\n".join(found)


def test_every_module_is_in_a_layer() -> None:
    lost = []
    for path in _modules():
        try:
            _room(_dotted(path))
        except ValueError:
            lost.append(str(path.relative_to(ROOT)))
    assert lost == [], f"modules in no layer of dflash_recipes/layers.py: {lost}"
    rooms = [room for layer in LAYERS for room in layer.rooms]
    assert len(rooms) == len(set(rooms)), f"a room in two layers: {rooms}"


def test_every_allowed_import_still_exists() -> None:
    graph = import_graph(type_only=True)
    stale = [edge for edge in KNOWN_BACKWARD_IMPORTS if edge[1] not in graph.get(edge[0], set())]
    assert stale == [], f"allowlisted imports that are gone; delete them: {stale}"


def test_the_layer_rule_refuses_an_upward_or_sideways_import() -> None:
    # the rule's own guard, on arrows this package had or could grow
    graph = {
        "dflash_recipes.executor.training.setup.device_memory": {
            "dflash_recipes.plan.resources.fit"
        },
        "dflash_recipes.executor.demo.runner": {"dflash_recipes.compiler.compilation"},
        "dflash_recipes.recipe.sections": {"dflash_recipes.recipe.choices"},
        "dflash_recipes.checkpoint.hfconfig": {"dflash_recipes.plan.run_plan"},
        "dflash_recipes.executor.regenerate.job": {"dflash_recipes.compiler.regenerate_checks"},
        "dflash_recipes.compiler.compilation": {"dflash_recipes.executor.model.draft"},
        "dflash_recipes.recipe.choices": {"dflash_recipes.recipe.sections"},
        "dflash_recipes": {"dflash_recipes.lazy"},
    }
    assert backward_imports(graph) == [
        "dflash_recipes.checkpoint.hfconfig -> dflash_recipes.plan.run_plan (checkpoint -> plan)",
        "dflash_recipes.compiler.compilation -> dflash_recipes.executor.model.draft "
        "(compiler -> executor)",
        "dflash_recipes.executor.regenerate.job -> dflash_recipes.compiler.regenerate_checks "
        "(executor -> compiler)",
        "dflash_recipes.recipe.choices -> dflash_recipes.recipe.sections "
        "(recipe.choices -> recipe)",
    ]


def test_the_cycle_finder_sees_a_circle_through_a_function_import(tmp_path: Path) -> None:
    # the rule's own guard: an import inside a function closes a circle too
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    lazy = tmp_path / "m.py"
    lazy.write_text("def f():\n    import dflash_recipes.errors\n")
    assert _imports(lazy, {"dflash_recipes.errors"}) == {"dflash_recipes.errors"}
    guarded = tmp_path / "g.py"
    guarded.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.y\n")
    assert _imports(guarded, {"x.y"}) == set()
    assert _imports(guarded, {"x.y"}, type_only=True) == {"x.y"}
    assert _folder_of("dflash_recipes.plan.run_plan") == "dflash_recipes.plan"
    assert _folder_of("dflash_recipes.plan") == "dflash_recipes.plan"


@pytest.mark.parametrize(
    "folder", sorted({p.parent for p in _modules()}), ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_folder_holds_more_than_twelve_modules(folder: Path) -> None:
    modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= MAX_MODULES_PER_FOLDER, f"{folder}: {sorted(modules)}"


def test_no_module_is_longer_than_700_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


#: Package files that are an API surface on purpose: the executor's public names (torch is
#: loaded with it anyway), the CLI, whose __init__ registers the commands, and the target-server
#: client's names (lazy exports: its __init__ imports only `dflash_recipes.lazy`).
_INIT_WITH_IMPORTS = {"executor", "cli", "target_server"}


def test_package_init_files_stay_light() -> None:
    # a subpackage __init__ runs on every import below it: the compile path's start-up budget
    heavy = [
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("__init__.py")
        if p.parent != PACKAGE
        and any(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.parse(p.read_text()).body)
        and p.parent.name not in _INIT_WITH_IMPORTS
    ]
    assert not heavy, f"subpackage __init__ files that import: {heavy}"


def test_most_modules_have_a_test_file_in_the_mirrored_folder() -> None:
    big = [
        p for p in _modules() if p.name != "__init__.py" and len(p.read_text().splitlines()) > 100
    ]
    mirrored = [
        p
        for p in big
        if (ROOT / "tests" / p.parent.relative_to(PACKAGE) / f"test_{p.stem}.py").is_file()
    ]
    missing = sorted(str(p.relative_to(ROOT)) for p in set(big) - set(mirrored))
    assert len(mirrored) >= 0.8 * len(big), (
        f"{len(mirrored)}/{len(big)} mirrored; without: {missing}"
    )


def _enumerations(path: Path, values: frozenset[str]) -> list[tuple[int, set[str]]]:
    """(line, values) of each tuple/list/set/Literal[...] in `path` naming 2+ of `values`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        elements: list[ast.expr] = []
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            elements = list(node.elts)
        strings = {e.value for e in elements if isinstance(e, ast.Constant)}
        named = {s for s in strings if isinstance(s, str)} & values
        if len(named) >= 2:
            found.append((node.lineno, named))
    return found


def _choice(name: str) -> frozenset[str]:
    from dflash_recipes.recipe import choices

    return frozenset(getattr(choices, name))


@pytest.mark.parametrize("choice", ["PROJECTOR_TYPES", "DTYPES", "SCHEDULERS", "LOSS_OBJECTIVES"])
def test_each_enumeration_is_written_in_exactly_one_module(choice: str) -> None:
    values = _choice(choice)
    homes = {
        str(p.relative_to(ROOT)): hits for p in _modules() if (hits := _enumerations(p, values))
    }
    assert list(homes) == ["dflash_recipes/recipe/choices.py"], homes


def test_every_map_keyed_by_dtype_names_covers_every_dtype() -> None:
    # the dtype maps (torch dtypes, safetensors codes) translate a choice; a new dtype in
    # choices.py without its translation is found here, not in a run
    dtypes = _choice("DTYPES")
    maps = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                if len(keys & dtypes) >= 2:
                    maps.append((str(path.relative_to(ROOT)), node.lineno, keys))
    assert maps, "no dtype map found: the scan itself is broken"
    incomplete = [(p, line) for p, line, keys in maps if keys != dtypes]
    assert not incomplete, incomplete


def test_the_enumeration_scan_finds_a_second_home(tmp_path: Path) -> None:
    copy = tmp_path / "m.py"
    copy.write_text('X = ("dflash", "domino")\nY: "Literal[1]"\n')
    assert _enumerations(copy, _choice("PROJECTOR_TYPES")) == [(1, {"dflash", "domino"})]


#: Where a drafter kind's name may be written: its two homes (the torch-free facts and the torch
#: half, each a module per kind beside its registry) and the enumeration itself.
_KIND_HOMES = (
    PACKAGE / "checkpoint" / "kinds",
    PACKAGE / "executor" / "kinds",
    PACKAGE / "recipe" / "choices.py",
)


def _kind_names_used(path: Path, names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, name) of each string constant in `path` naming a drafter kind, docstrings and a
    field's `default=` aside: the comparisons, lookups and branches of an `if kind == ...`
    chain all spell one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    allowed: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            allowed.add(id(body[0].value))  # a docstring
        if isinstance(node, ast.keyword) and node.arg == "default":
            allowed.add(id(node.value))  # a recipe or layout field's default kind
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in names
        and id(node) not in allowed
    ]


def test_no_drafter_kind_is_named_outside_its_homes() -> None:
    # one home per kind (docs/dflash.md, "Architecture", "a drafter kind"): code elsewhere asks
    # the kind's registry (kind_facts, kind_modules), never branches on a projector type's name
    names = _choice("PROJECTOR_TYPES")
    outside = {
        str(p.relative_to(ROOT)): hits
        for p in _modules()
        if not any(p == home or home in p.parents for home in _KIND_HOMES)
        and (hits := _kind_names_used(p, names))
    }
    assert not outside, f"drafter kinds named outside their homes: {outside}"


def test_kind_modules_are_reached_through_their_registries() -> None:
    # a module that imports a kind's module directly has a kind chain in disguise
    kinds = {
        f"dflash_recipes.{half}.kinds.{name}"
        for half in ("checkpoint", "executor")
        for name in _choice("PROJECTOR_TYPES")
    }
    graph = import_graph()
    direct = {
        name: sorted(edges & kinds)
        for name, edges in graph.items()
        if edges & kinds and ".kinds." not in name
    }
    assert not direct, direct
    assert kinds <= set(graph), "a kind has no module in one of its two homes"


def test_the_kind_name_scan_finds_a_chain_and_spares_docstrings_and_defaults(
    tmp_path: Path,
) -> None:
    chain = tmp_path / "m.py"
    chain.write_text(
        '"""dspark in a docstring."""\n'
        "import attrs\n"
        'x = attrs.field(default="dflash")\n'
        'if kind == "domino":\n'
        "    pass\n"
        'y = {"dspark": 1}.get(kind, "dflash")\n'
    )
    found = _kind_names_used(chain, _choice("PROJECTOR_TYPES"))
    assert sorted(found) == [(4, "domino"), (6, "dflash"), (6, "dspark")]
