"""A packed row is three conversations trained side by side, never one conversation of three.

Issue 40's must-show: a row packing three conversations gives the target taps, the drafter's
outputs at every anchor, the loss and the drafter's gradients of the three conversations run
one per row with the same anchors (up to float rounding), and a token of one document changes
nothing in another's outputs. Runs the CPU path of the step (SDPA target with the
block-diagonal mask, the split block mask of the drafter).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testkit.numerics import assert_equal_up_to_rounding
from testkit.tiny import randomize, tiny_plan, tiny_target
from torch import Tensor

from dflash_recipes.executor.data.train_dataset import Batch
from dflash_recipes.executor.model.convert import ConvertedModel, convert, dflash_module, lm_head
from dflash_recipes.executor.training.anchors import AnchorBatch, eligible_anchor_mask
from dflash_recipes.executor.training.loss import LossOutput
from dflash_recipes.executor.training.step import DraftStep, StepInputs, step_inputs
from dflash_recipes.plan.run_plan import RunPlan

BLOCK = 4
#: (tokens, prompt tokens) of the three conversations; the packed row is 40 with 5 of filler.
DOCS = ((11, 3), (15, 5), (9, 2))
ROW = 40
#: The anchors of each conversation, in its own positions (all eligible; checked below).
ANCHORS = ((3, 5, 7), (5, 6, 9, 11), (2, 4))

VARIANTS = {
    "dflash": {},
    # the teacher's logits come from the whole causal LM (target_states with logits)
    "dflash-dpace-distill": {
        "loss_objective": "dpace",
        "dpace_alpha": 0.7,
        "self_logit_distillation": True,
    },
}


def _conversations(vocab: int, seed: int = 3) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, prompt in DOCS:
        ids = torch.randint(0, vocab, (n,), generator=gen)
        loss = torch.ones(n, dtype=torch.long)
        loss[:prompt] = 0
        out.append((ids, loss))
    return out


def _one_per_row(convs: list[tuple[Tensor, Tensor]]) -> tuple[Batch, AnchorBatch]:
    longest = max(len(ids) for ids, _ in convs)
    ids = torch.zeros(len(convs), longest, dtype=torch.long)
    attention, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    anchors = torch.zeros(len(convs), max(map(len, ANCHORS)), dtype=torch.long)
    valid = torch.zeros_like(anchors, dtype=torch.bool)
    for r, ((tokens, supervised), mine) in enumerate(zip(convs, ANCHORS, strict=True)):
        ids[r, : len(tokens)], loss[r, : len(tokens)] = tokens, supervised
        attention[r, : len(tokens)] = 1
        anchors[r, : len(mine)] = torch.tensor(mine)
        valid[r, : len(mine)] = True
    return Batch(ids, attention, loss, 0, len(convs)), AnchorBatch(anchors, valid)


def _packed(convs: list[tuple[Tensor, Tensor]]) -> tuple[Batch, AnchorBatch, list[int]]:
    ids = torch.zeros(1, ROW, dtype=torch.long)
    attention, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    docs = torch.full_like(ids, -1)
    starts, anchors, start = [], [], 0
    for number, ((tokens, supervised), mine) in enumerate(zip(convs, ANCHORS, strict=True)):
        end = start + len(tokens)
        ids[0, start:end], loss[0, start:end] = tokens, supervised
        attention[0, start:end], docs[0, start:end] = 1, number
        starts.append(start)
        anchors.extend(start + a for a in mine)
        start = end
    drawn = AnchorBatch(torch.tensor([anchors]), torch.ones(1, len(anchors), dtype=torch.bool))
    return Batch(ids, attention, loss, 0, 1, document_ids=docs), drawn, starts


def _setup(tmp_path: Path, **overrides: object) -> tuple[RunPlan, ConvertedModel, DraftStep]:
    plan = tiny_plan(tmp_path, block_size=BLOCK, **overrides)
    model = convert(tiny_target(plan), plan)
    drafter = dflash_module(model)
    randomize(drafter)
    return plan, model, DraftStep(drafter, lm_head(model), plan.draft.objective)


def _inputs(plan: RunPlan, model: ConvertedModel, batch: Batch, drawn: AnchorBatch) -> StepInputs:
    spec = plan.resolved_draft()
    return step_inputs(model, spec, plan.draft.objective, batch, drawn, step=2, total_steps=10)


def _drafter_out(step: DraftStep, inputs: StepInputs) -> Tensor:
    """The drafter's final states ``[B, N, K, H]`` at every block."""
    drafter = step.drafter
    hidden = drafter(
        inputs.block_embeds,
        drafter.fuse_context(inputs.tapped),
        inputs.q_positions,
        inputs.ctx_positions,
        inputs.mask,
    )
    return hidden.view(hidden.shape[0], -1, BLOCK, hidden.shape[-1])


def _loss_and_grads(step: DraftStep, inputs: StepInputs) -> tuple[Tensor, dict[str, Tensor]]:
    step.drafter.zero_grad(set_to_none=True)
    result = step(inputs)
    assert isinstance(result, LossOutput)
    result.loss.backward()
    grads = {n: p.grad.clone() for n, p in step.drafter.named_parameters() if p.grad is not None}
    return result.loss.detach(), grads


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_packed_row_equals_its_three_conversations_one_per_row(
    tmp_path: Path, variant: str
) -> None:
    plan, model, step = _setup(tmp_path, **VARIANTS[variant])
    convs = _conversations(plan.resolved_draft().mask_token_id)
    alone_batch, alone_drawn = _one_per_row(convs)
    packed_batch, packed_drawn, starts = _packed(convs)
    # the anchors are eligible both ways (the packed row's rule: inside one document)
    assert packed_batch.document_ids is not None
    eligible = eligible_anchor_mask(
        packed_batch.loss_mask, packed_batch.attention_mask, block_size=BLOCK,
        document_ids=packed_batch.document_ids,
    )  # fmt: skip
    assert bool(eligible[0, packed_drawn.anchors[0]].all())
    alone = _inputs(plan, model, alone_batch, alone_drawn)
    packed = _inputs(plan, model, packed_batch, packed_drawn)

    with torch.no_grad():
        alone_out, packed_out = _drafter_out(step, alone), _drafter_out(step, packed)
    block = 0
    for d, ((tokens, _), mine) in enumerate(zip(convs, ANCHORS, strict=True)):
        n, s = len(tokens), starts[d]
        assert_equal_up_to_rounding(
            packed.tapped[0, s : s + n], alone.tapped[d, :n], what=f"document {d}'s taps"
        )
        for j in range(len(mine)):
            assert_equal_up_to_rounding(
                packed_out[0, block + j], alone_out[d, j], what=f"document {d} block {j}"
            )
            assert torch.equal(packed.targets.labels[0, block + j], alone.targets.labels[d, j]), (
                f"document {d} block {j}'s labels"
            )
        block += len(mine)

    alone_loss, alone_grads = _loss_and_grads(step, alone)
    packed_loss, packed_grads = _loss_and_grads(step, packed)
    assert_equal_up_to_rounding(packed_loss, alone_loss, what="the loss")
    assert alone_grads.keys() == packed_grads.keys() and alone_grads
    for name, grad in alone_grads.items():
        assert_equal_up_to_rounding(packed_grads[name], grad, what=f"{name}'s gradient")


def test_a_token_of_one_document_changes_nothing_in_anothers_outputs(tmp_path: Path) -> None:
    plan, model, step = _setup(tmp_path)
    convs = _conversations(plan.resolved_draft().mask_token_id)
    batch, drawn, starts = _packed(convs)
    changed_ids = batch.input_ids.clone()
    changed_ids[0, starts[1] + 6] = (changed_ids[0, starts[1] + 6] + 1) % 100  # document 1
    changed = Batch(
        changed_ids, batch.attention_mask, batch.loss_mask, 0, 1, document_ids=batch.document_ids
    )
    with torch.no_grad():
        before = _inputs(plan, model, batch, drawn)
        after = _inputs(plan, model, changed, drawn)
        out_before, out_after = _drafter_out(step, before), _drafter_out(step, after)
    first, second = len(ANCHORS[0]), len(ANCHORS[0]) + len(ANCHORS[1])
    for d, blocks in ((0, slice(0, first)), (2, slice(second, None))):
        n, s = DOCS[d][0], starts[d]
        assert torch.equal(before.tapped[0, s : s + n], after.tapped[0, s : s + n]), d
        assert torch.equal(out_before[0, blocks], out_after[0, blocks]), d
    # the change is real: document 1's own blocks after the token move
    assert not torch.equal(out_before[0, first:second], out_after[0, first:second])
