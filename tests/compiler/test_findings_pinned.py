"""What a user reads for each compile check, word for word: one scenario per finding family.

Each scenario builds a tiny base model, checkpoint and recipe in its own folder and compiles;
every diagnostic (code, severity, dotted path, message, hint) is compared with the text pinned
in `compile_findings.golden.json`. A check deleted, turned around or reworded makes its scenario
fail. After changing a message on purpose, rewrite the file with
`DFLASH_UPDATE_GOLDEN=1 python -m pytest tests/compiler/test_findings_pinned.py` and review the
diff.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from testkit.compiling import compile_in, make_training_checkpoint
from testkit.st_fixtures import (
    drafter_config,
    drafter_tensors,
    write_base_model,
    write_drafter_checkpoint,
    write_json,
    write_raw_safetensors,
    write_safetensors,
)

from dflash_recipes.compiler.compilation import CompileResult
from dflash_recipes.files.run_dir import PLAN_FILE
from dflash_recipes.recipe.sections import Recipe

RecipeFactory = Callable[..., Recipe]
Scenario = Callable[[Path, RecipeFactory], Recipe]
GOLDEN = Path(__file__).with_name("compile_findings.golden.json")
DOMINO = {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8}
SLIDING = ("sliding_attention", "full_attention")


def _drafter(tmp: Path, **kwargs: Any) -> None:
    write_drafter_checkpoint(tmp / "drafter", **kwargs)


def _sliding_drafter(tmp: Path, window: int | None = 2048) -> None:
    config = drafter_config(target_layer_ids=[1, 5])
    config["layer_types"] = list(SLIDING)
    if window is not None:
        config["sliding_window"] = window
    _drafter(tmp, config=config)


def _without(key: str) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        config = drafter_config()
        del config["dflash_config"][key]  # type: ignore[attr-defined]
        _drafter(tmp, config=config)

    return write


def _s(setup: Callable[[Path], None] | None = None, **recipe: Any) -> Scenario:
    def build(tmp: Path, make_recipe: RecipeFactory) -> Recipe:
        if setup is not None:
            setup(tmp)
        return make_recipe(**recipe)

    return build


def _without_layer_types(tmp: Path) -> None:
    """A checkpoint whose config.json says nothing about attention kinds (full by default)."""
    config = drafter_config()
    del config["layer_types"]
    _drafter(tmp, config=config)


def _tensors(
    tmp: Path, renames: dict[str, str] | None = None, add: dict[str, Any] | None = None
) -> None:
    """A drafter whose tensors are stored under `renames` (z-lab name -> stored name), with
    `add` (stored name -> (dtype, shape)) stored besides."""
    tensors = drafter_tensors()
    stored = {(renames or {}).get(n, n): spec for n, spec in tensors.items()}
    write_safetensors(tmp / "drafter" / "model.safetensors", {**stored, **(add or {})})
    write_json(tmp / "drafter" / "config.json", drafter_config())


def _without_taps_config() -> dict[str, Any]:
    config = drafter_config()
    del config["dflash_config"]["target_layer_ids"]  # type: ignore[attr-defined]
    del config["dflash_config"]["mask_token_id"]  # type: ignore[attr-defined]
    return config


def _truncated_weights(tmp: Path) -> None:
    """Weights cut short, next to a config.json stating neither taps nor mask."""
    write_raw_safetensors(tmp / "drafter" / "model.safetensors", b'{"a": 1}', length=4096)
    write_json(tmp / "drafter" / "config.json", _without_taps_config())


def _unreadable_config(tmp: Path) -> None:
    _drafter(tmp, write_config=False)
    (tmp / "drafter" / "config.json").write_text('{"hidden_size": 32,', encoding="utf-8")


def _resume(tmp: Path) -> None:
    _drafter(tmp)
    make_training_checkpoint(tmp / "out", 3)


def _resume_after_a_run(tmp: Path, make_recipe: RecipeFactory) -> Recipe:
    """A run that took its taps, mask and windows from a checkpoint since deleted."""
    _sliding_drafter(tmp)
    recipe = make_recipe(training={"output_dir": "out"})
    first = compile_in(tmp, recipe)
    assert first.plan is not None
    make_training_checkpoint(tmp / "out", 10)
    (tmp / "out" / PLAN_FILE).write_text(first.plan.to_json(), encoding="utf-8")
    shutil.rmtree(tmp / "drafter")
    return recipe


def _resume_after(first: dict[str, Any], then: dict[str, Any]) -> Scenario:
    """A resume whose recipe changed from `first` to `then` (arch fields) since the run began;
    the run's init checkpoint is gone."""

    def build(tmp: Path, make_recipe: RecipeFactory) -> Recipe:
        _drafter(tmp)
        started = compile_in(tmp, make_recipe(arch=first, training={"output_dir": "out"}))
        assert started.plan is not None, started.diagnostics
        make_training_checkpoint(tmp / "out", 10)
        (tmp / "out" / PLAN_FILE).write_text(started.plan.to_json(), encoding="utf-8")
        shutil.rmtree(tmp / "drafter")
        return make_recipe(arch=then, training={"output_dir": "out"})

    return build


SCENARIOS: dict[str, Scenario] = {
    "warm-start-takes-taps-and-mask": _s(_drafter),
    "taps-differ": _s(_drafter, arch={"target_layer_ids": (2, 6)}),
    "mask-differs": _s(_drafter, dflash={"dflash_mask_token_id": 7}),
    "mask-out-of-range": _s(_drafter, dflash={"dflash_mask_token_id": 256}),
    "taps-out-of-range": _s(_drafter, arch={"target_layer_ids": (1, 8)}),
    "checkpoint-taps-beyond-target": _s(
        lambda t: (_drafter(t), write_base_model(t / "base", layers=4))
    ),
    "checkpoint-without-mask": _s(_without("mask_token_id")),
    "checkpoint-without-taps": _s(_without("target_layer_ids")),
    "no-checkpoint-default-taps": _s(init=None, dflash={"dflash_mask_token_id": 1}),
    "no-checkpoint-no-mask": _s(init=None),
    "another-target": _s(lambda t: _drafter(t, config=drafter_config(num_target_layers=36))),
    "hidden-size-mismatch": _s(lambda t: (_drafter(t), write_base_model(t / "base", hidden=64))),
    "layout-mismatch": _s(lambda t: _drafter(t, intermediate=96, config=drafter_config())),
    "layout-mismatch-two-fixes": _s(
        lambda t: _drafter(t, intermediate=96, layers=3, config=drafter_config())
    ),
    "head-into-plain-recipe": _s(lambda t: _drafter(t, projector_type="dspark", markov_rank=4)),
    "plain-checkpoint-into-domino": _s(_drafter, arch=DOMINO),
    "partly-present-head": _s(
        lambda t: _drafter(
            t,
            projector_type="domino",
            emb_dim=16,
            gru_hidden_dim=8,
            drop=["prefix_gru.weight_hh_l0"],
        ),
        arch=DOMINO,
    ),
    "sliding-taken-from-checkpoint": _s(_sliding_drafter),
    "sliding-differs": _s(_sliding_drafter, arch={"layer_types": SLIDING, "sliding_window": 512}),
    "sliding-checkpoint-without-window": _s(lambda t: _sliding_drafter(t, window=None)),
    "layer-types-wrong-length": _s(_drafter, arch={"layer_types": ("full_attention",)}),
    "sliding-layer-types-wrong-length": _s(
        init=None, arch={"layer_types": ("sliding_attention",)}, dflash={"dflash_mask_token_id": 1}
    ),
    "sliding-recipe-without-window": _s(
        init=None, arch={"layer_types": SLIDING}, dflash={"dflash_mask_token_id": 1}
    ),
    "sliding-recipe-checkpoint-silent": _s(
        _without_layer_types, arch={"layer_types": SLIDING, "sliding_window": 512}
    ),
    "window-without-sliding-layers": _s(_drafter, arch={"sliding_window": 512}),
    "rope-differs": _s(lambda t: _drafter(t, config=drafter_config(rope_theta=10_000.0))),
    "config-json-missing": _s(
        lambda t: _drafter(t, write_config=False),
        arch={"target_layer_ids": (1, 5)},
        dflash={"dflash_mask_token_id": 250},
    ),
    "resume": _s(_resume, training={"output_dir": "out"}),
    "resume-after-a-run": _resume_after_a_run,
    "output-dir-is-a-file": _s(
        lambda t: (_drafter(t), (t / "out").write_text("")), training={"output_dir": "out"}
    ),
    "dims-missing-kv-not-divisor": _s(
        init=None,
        arch={"num_attention_heads": None, "num_key_value_heads": 3},
        dflash={"dflash_mask_token_id": 1},
    ),
    "head-fields": _s(init=None, arch={"emb_dim": 16}, dflash={"dflash_mask_token_id": 1}),
    "head-field-missing": _s(
        init=None, arch={"projector_type": "dspark"}, dflash={"dflash_mask_token_id": 1}
    ),
    "duplicate-taps-eval-unset": _s(
        init=None,
        arch={"target_layer_ids": (1, 1)},
        dflash={"dflash_mask_token_id": 1},
        training={"eval_steps": 10},
    ),
    "data-unset-and-missing-files": _s(
        init=None,
        dflash={"dflash_mask_token_id": 1},
        data={"data_path": None, "eval_data_path": "absent.jsonl"},
    ),
    "init-checkpoint-missing": _s(init="absent"),
    "init-checkpoint-empty": _s(lambda t: (t / "drafter").mkdir()),
    "init-checkpoint-without-weights": _s(
        lambda t: ((t / "drafter").mkdir(), (t / "drafter" / "config.json").write_text("{}"))
    ),
    "base-model-missing": _s(_drafter, model="nowhere"),
    # checkpoint_checks: known layouts, clashes, tensors no layout reads, damaged inputs
    "layout-renamed": _s(lambda t: _tensors(t, {"fc.weight": "encoder.fc.weight"})),
    "name-clash": _s(
        lambda t: _tensors(t, add={"encoder.fc.weight": drafter_tensors()["fc.weight"]})
    ),
    "unknown-extra-tensor": _s(lambda t: _tensors(t, add={"encoder.gate.weight": ("BF16", (32,))})),
    "tensor-missing-no-fix": _s(lambda t: _drafter(t, drop=["hidden_norm.weight"])),
    "weights-truncated": _s(_truncated_weights),
    "config-json-unreadable": _s(_unreadable_config),
    "rms-norm-eps-differs": _s(_drafter, arch={"rms_norm_eps": 1e-5}),
    "another-target-twice": _s(
        lambda t: _drafter(t, config=drafter_config(num_target_layers=36, vocab=300))
    ),
    # id_checks: what a resumed run's plan supplies, taps no formula can place
    "resume-keeps-full-attention": _resume_after({"layer_types": ("full_attention",) * 2}, {}),
    "resume-layer-types-wrong-length": _resume_after(
        {"layer_types": SLIDING, "sliding_window": 64}, {"num_hidden_layers": 3}
    ),
    "default-taps-impossible": _s(
        lambda t: write_base_model(t / "base", layers=1),
        init=None,
        dflash={"dflash_mask_token_id": 1},
    ),
    "no-mask-no-base-model": _s(init=None, model="nowhere"),
    "draft-layers-unset": _s(_drafter, arch={"num_hidden_layers": None}),
    # recipe_checks: the rules on the recipe alone
    "kv-heads-prime-heads": _s(
        init=None,
        arch={"num_attention_heads": 5, "num_key_value_heads": 3},
        dflash={"dflash_mask_token_id": 1},
    ),
    "kv-heads-above-heads": _s(
        init=None,
        arch={"num_attention_heads": 4, "num_key_value_heads": 6},
        dflash={"dflash_mask_token_id": 1},
    ),
    "dim-unset-checkpoint-unreadable": _s(
        lambda t: write_raw_safetensors(t / "drafter" / "model.safetensors", b"{", length=9),
        arch={"target_layer_ids": (1, 5), "num_attention_heads": None},
        dflash={"dflash_mask_token_id": 250},
    ),
    "resume-dim-unset": _resume_after({}, {"intermediate_size": None}),
    "confidence-head-without-dspark": _s(
        init=None, arch={"use_confidence_head": True}, dflash={"dflash_mask_token_id": 1}
    ),
    "domino-prefix-fills-the-block": _s(
        init=None, arch={**DOMINO, "pure_draft_prefix_len": 16}, dflash={"dflash_mask_token_id": 1}
    ),
    "plain-checkpoint-into-domino-unshifted": _s(_drafter, arch={**DOMINO, "shift_label": False}),
}


def _pin(tmp: Path, result: CompileResult) -> list[dict[str, str]]:
    def plain(text: str) -> str:
        return text.replace(str(tmp.resolve()), "<tmp>").replace(str(tmp), "<tmp>")

    return sorted(
        (
            {
                "code": d.code,
                "severity": d.severity.value,
                "path": d.path or "",
                "message": plain(d.message),
                "hint": plain(d.hint or ""),
            }
            for d in result.diagnostics
        ),
        key=lambda row: (row["code"], row["path"], row["message"]),
    )


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_finding_reads_as_pinned(
    tmp_path: Path, make_recipe: RecipeFactory, name: str
) -> None:
    found = _pin(tmp_path, compile_in(tmp_path, SCENARIOS[name](tmp_path, make_recipe)))
    assert found, "a scenario without a finding pins nothing"
    pinned = json.loads(GOLDEN.read_text(encoding="utf-8")) if GOLDEN.is_file() else {}
    if os.environ.get("DFLASH_UPDATE_GOLDEN"):
        pinned[name] = found
        GOLDEN.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    assert found == pinned.get(name)


def test_every_pinned_scenario_still_exists() -> None:
    assert sorted(json.loads(GOLDEN.read_text(encoding="utf-8"))) == sorted(SCENARIOS)
