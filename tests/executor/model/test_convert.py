"""Conversion: a frozen Qwen3/Llama target with the drafter attached, sharing embeddings/head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testkit.tiny import TINY_MASK_TOKEN_ID, TINY_VOCAB, tiny_plan, tiny_target

from dflash_recipes.errors import CheckpointError, PlanError
from dflash_recipes.executor.model.convert import (
    convert,
    dflash_module,
    embed_tokens,
    lm_head,
    load_base_model,
)
from dflash_recipes.executor.model.draft import taps_from_hidden_states
from dflash_recipes.executor.model.masks import build_dense_block_mask
from dflash_recipes.executor.training.anchors import block_positions


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_convert_attaches_a_trainable_drafter_to_a_frozen_base(tmp_path: Path, family: str) -> None:
    plan = tiny_plan(tmp_path, target_model_type=family)
    base = tiny_target(plan)
    model = convert(base, plan)
    assert model is base
    drafter = dflash_module(model)
    assert model.dflash_module is drafter
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"dflash_module.{n}" for n, _ in drafter.named_parameters()}
    # Embeddings and lm_head are the base's own modules, not copies inside the drafter.
    assert embed_tokens(model) is base.model.embed_tokens
    assert lm_head(model) is base.lm_head
    drafter_tensors = {t.data_ptr() for t in drafter.state_dict().values()}
    assert base.lm_head.weight.data_ptr() not in drafter_tensors
    assert base.model.embed_tokens.weight.data_ptr() not in drafter_tensors
    assert not any("embed" in n or "lm_head" in n for n in drafter.state_dict())


def test_drafter_init_follows_the_plan_seed(tmp_path: Path) -> None:
    first = convert(tiny_target(tiny_plan(tmp_path)), tiny_plan(tmp_path, seed=1))
    again = convert(tiny_target(tiny_plan(tmp_path)), tiny_plan(tmp_path, seed=1))
    other = convert(tiny_target(tiny_plan(tmp_path)), tiny_plan(tmp_path, seed=2))
    assert torch.equal(first.dflash_module.fc.weight, again.dflash_module.fc.weight)
    assert not torch.equal(first.dflash_module.fc.weight, other.dflash_module.fc.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_converted_model_drafts_a_block_end_to_end(tmp_path: Path, dtype: torch.dtype) -> None:
    plan = tiny_plan(tmp_path)
    model = convert(tiny_target(plan).to(dtype), plan)
    model.dflash_module.float()  # float32 master weights under a (possibly bf16) target
    drafter = model.dflash_module
    ids = torch.randint(0, 100, (2, 12))
    anchors = torch.tensor([[3, 6], [2, 8]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    block = 4
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    context = drafter.fuse_context(taps_from_hidden_states(out.hidden_states, (1, 2)))
    block_ids = torch.full((2, 2 * block), TINY_MASK_TOKEN_ID)
    block_ids[:, ::block] = ids.gather(1, anchors)
    states = drafter(
        embed_tokens(model)(block_ids),
        context,
        block_positions(anchors, block),
        torch.arange(12).expand(2, 12),
        build_dense_block_mask(anchors, block, 12, valid),
    )
    assert states.dtype == torch.float32
    logits = lm_head(model)(states.to(dtype))
    assert logits.shape == (2, 2 * block, TINY_VOCAB)
    logits.logsumexp(-1).mean().backward()
    assert drafter.fc.weight.grad is not None
    assert model.lm_head.weight.grad is None, "the base is frozen"


def test_base_model_that_does_not_match_the_plan_is_refused(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path)
    other = tiny_target(tiny_plan(tmp_path, target_num_hidden_layers=6))
    with pytest.raises(PlanError, match="num_hidden_layers: plan 4, model 6"):
        convert(other, plan)


def test_mask_token_outside_the_embedding_table_is_refused(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, mask_token_id=TINY_VOCAB)
    with pytest.raises(PlanError, match="mask_token_id 128 is not a row"):
        convert(tiny_target(plan), plan)


def test_converting_twice_is_refused(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path)
    model = convert(tiny_target(plan), plan)
    with pytest.raises(ValueError, match="already has a dflash_module"):
        convert(model, plan)


def test_load_base_model_reads_the_local_directory_in_the_plan_dtype(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, dtype="bfloat16")
    saved = tiny_target(plan, save=True)
    loaded = load_base_model(plan)
    assert loaded.dtype == torch.bfloat16
    assert not loaded.training
    assert torch.equal(loaded.lm_head.weight, saved.lm_head.weight.to(torch.bfloat16))


def test_load_base_model_without_a_local_directory_says_how_to_stage_it(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path)
    with pytest.raises(CheckpointError, match="hf download"):
        load_base_model(plan)
