"""The torch halves of the drafter kinds: one per projector type, each agreeing with its
torch-free half on the tensors it adds and reading its head inputs per block."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testkit.tiny import tiny_plan

from dflash_recipes.checkpoint.kinds.registry import KINDS
from dflash_recipes.checkpoint.tensor_layout import expected_layout
from dflash_recipes.executor.kinds.registry import KIND_MODULES, kind_modules
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.warmstart import layout_spec
from dflash_recipes.recipe.choices import PROJECTOR_TYPES

#: The kinds this version trains: their torch half is registered (a kind whose facts say
#: ``trains = False`` is refused at compile with ``<name>-not-yet``; every kind trains today).
TRAINED = tuple(name for name in PROJECTOR_TYPES if KINDS[name].trains)

#: A tiny drafter of each kind, with every optional part of its head switched on.
SIZED: dict[str, dict[str, object]] = {
    "dflash": {},
    "domino": {"emb_dim": 16, "gru_hidden_dim": 8},
    "dspark": {"markov_rank": 4, "use_confidence_head": True, "markov_head_type": "rnn"},
    "dflash2": {
        "conv_kernel_size": 2,
        "conv_group_size": 8,
        "selector_rank": 4,
        "selector_top_k": 4,
    },
}


def test_the_registry_holds_exactly_the_recipes_projector_types_in_order() -> None:
    assert tuple(KIND_MODULES) == TRAINED
    assert tuple(KINDS) == PROJECTOR_TYPES
    assert all(kind.name == name for name, kind in KIND_MODULES.items())
    assert set(SIZED) == set(TRAINED)
    with pytest.raises(
        ValueError, match="projector_type must be one of dflash, domino, dspark, dflash2"
    ):
        kind_modules("medusa")


@pytest.mark.parametrize("name", TRAINED)
def test_a_kinds_modules_hold_exactly_the_tensors_its_layout_declares(
    tmp_path: Path, name: str
) -> None:
    spec = tiny_plan(tmp_path, projector_type=name, **SIZED[name]).resolved_draft()
    drafter = DFlashDraftModel(spec)
    shapes = {n: tuple(t.shape) for n, t in drafter.state_dict().items()}
    assert shapes == expected_layout(layout_spec(spec))
    head = drafter.head
    assert (head is None) == (not KINDS[name].layout(layout_spec(spec)))


@pytest.mark.parametrize("name", TRAINED)
def test_head_inputs_are_per_block(tmp_path: Path, name: str) -> None:
    spec = tiny_plan(tmp_path, projector_type=name, **SIZED[name]).resolved_draft()
    ids = torch.randint(0, spec.vocab_size, (2, 30))
    anchors = torch.tensor([[3, 9, 20], [0, 5, 11]])
    embeddings = torch.nn.Embedding(spec.vocab_size, spec.hidden_size)
    with torch.no_grad():
        inputs = kind_modules(name).head_inputs(spec, ids, anchors, embeddings)
    assert all(t.shape[:3] == (2, 3, spec.block_size) for t in inputs)
    assert bool(inputs) == (name != "dflash")
