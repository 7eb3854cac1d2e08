"""The compile path stays pure data and quick to start.

No torch, transformers, safetensors or numpy; and none of the modules that only cost start-up
there (issue 15): cattrs (plans are read with it, recipes are not) and OpenSSL's `_hashlib`
(the plan fingerprint uses CPython's built-in SHA-256).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from testkit.st_fixtures import write_json

HEAVY = ("torch", "transformers", "safetensors", "numpy")
START_UP = ("cattrs", "_hashlib")

_SCRIPT = """
import json, sys
from pathlib import Path
from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.recipe.starter import render_init_recipe

result = compile_file(sys.argv[1])
schema = compile_file(sys.argv[1], resolve=False)
text = render_init_recipe(Path(sys.argv[2]), Path(sys.argv[3]))
heavy = sorted(m for m in sys.argv[4:] if m in sys.modules)
print(json.dumps({"ok": result.ok and schema.ok, "init": len(text), "heavy": heavy}))
"""


def test_compile_lint_and_init_import_no_heavy_module(
    tmp_path: Path,
    base_model: Path,
    drafter: Path,
    train_file: Path,
    recipe_text: Callable[..., str],
    write_recipe: Callable[..., Path],
) -> None:
    write_json(base_model / "tokenizer.json", {"model": {"vocab": {"a": 0}}, "added_tokens": []})
    path = write_recipe(recipe_text())
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _SCRIPT,
            str(path),
            str(base_model),
            str(drafter),
            *HEAVY,
            *START_UP,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(done.stdout)
    assert report["ok"] and report["init"] > 0
    assert report["heavy"] == []
