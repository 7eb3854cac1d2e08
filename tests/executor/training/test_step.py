"""lm_head + head + loss per chunk of blocks (large vocabularies) equals the unchunked step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testkit.tiny import TINY_VOCAB, randomize, tiny_plan, tiny_target
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_recipes.executor.data.train_dataset import Batch
from dflash_recipes.executor.kinds.dflash import dflash_loss
from dflash_recipes.executor.model.convert import convert, dflash_module, lm_head
from dflash_recipes.executor.training.anchors import AnchorBatch, sample_anchors
from dflash_recipes.executor.training.loss import LossOutput, combine_losses
from dflash_recipes.executor.training.step import DraftStep, StepInputs, step_inputs
from dflash_recipes.plan.run_plan import RunPlan

BLOCK = 4
BATCH = 2

VARIANTS = {
    "dflash-decay": {},
    "dflash-dpace-distill": {
        "loss_objective": "dpace",
        "dpace_alpha": 0.7,
        "self_logit_distillation": True,
    },
    "domino-distill": {
        "projector_type": "domino",
        "emb_dim": 16,
        "gru_hidden_dim": 8,
        "self_logit_distillation": True,
        "domino_backbone_loss_weight": 0.5,
    },
    "dspark-tv-confidence": {
        "projector_type": "dspark",
        "markov_rank": 4,
        "use_confidence_head": True,
        "dspark_tv_weight": 0.3,
        "dspark_confidence_weight": 0.2,
        "loss_objective": "dpace",
        "dpace_alpha": 0.5,
    },
}


def _step_inputs(plan: RunPlan, rows: int = BATCH) -> tuple[DraftStep, StepInputs]:
    """A DraftStep over random weights and one micro-step's inputs (prompts unsupervised)."""
    model = convert(tiny_target(plan), plan)
    drafter = dflash_module(model)
    randomize(drafter)
    spec = plan.resolved_draft()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, spec.mask_token_id, (BATCH, 40), generator=gen)
    attention = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, :9] = 0  # a prompt: the two rows supervise different numbers of positions
    loss_mask[1, :3] = 0
    drawn = sample_anchors(loss_mask, attention, block_size=BLOCK, num_anchors=7, generator=gen)
    ids, attention, loss_mask = ids[:rows], attention[:rows], loss_mask[:rows]
    drawn = AnchorBatch(drawn.anchors[:rows], drawn.valid[:rows])
    batch = Batch(ids, attention, loss_mask, epoch=0, next_index=rows)
    inputs = step_inputs(model, spec, plan.draft.objective, batch, drawn, step=3, total_steps=10)
    return DraftStep(drafter, lm_head(model), plan.draft.objective), inputs


def _run(step: DraftStep, inputs: StepInputs) -> tuple[LossOutput, dict[str, Tensor]]:
    step.drafter.zero_grad(set_to_none=True)
    result = step(inputs)
    assert isinstance(result, LossOutput)
    result.loss.backward()
    grads = {
        name: p.grad.clone() for name, p in step.drafter.named_parameters() if p.grad is not None
    }
    return result, grads


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chunked_step_equals_the_whole_batch_step(tmp_path: Path, variant: str) -> None:
    plan = tiny_plan(tmp_path, block_size=BLOCK, **VARIANTS[variant])
    step, inputs = _step_inputs(plan)
    n_blocks = inputs.targets.labels.shape[1]
    whole, whole_grads = _run(step, inputs)
    assert step.blocks_per_chunk(BATCH, n_blocks) == n_blocks  # tiny vocab: one chunk
    assert whole.per_position_count.sum() > 0
    per_block = BATCH * BLOCK * TINY_VOCAB
    for blocks in (1, 2, 3):  # 3 leaves an uneven last chunk
        step.max_chunk_logits = blocks * per_block
        assert step.blocks_per_chunk(BATCH, n_blocks) == blocks
        chunked, grads = _run(step, inputs)
        torch.testing.assert_close(chunked.loss, whole.loss, rtol=1e-5, atol=1e-6)
        for part in ("ce", "weight_sum"):
            torch.testing.assert_close(
                getattr(chunked, part), getattr(whole, part), rtol=1e-5, atol=1e-6
            )
        for terms in ("parts", "counted_parts"):
            ours, theirs = getattr(chunked, terms), getattr(whole, terms)
            assert ours.keys() == theirs.keys(), terms
            for name, value in ours.items():
                torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(chunked.per_position_correct, whole.per_position_correct)
        assert torch.equal(chunked.per_position_count, whole.per_position_count)
        assert grads.keys() == whole_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, whole_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    step.max_chunk_logits = None


def test_chunks_bound_the_logits_held_at_once(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, block_size=BLOCK)
    step, inputs = _step_inputs(plan)
    n_blocks = inputs.targets.labels.shape[1]
    sizes: list[int] = []
    hook = step._lm_head.register_forward_hook(  # type: ignore[union-attr]
        lambda _m, _i, out: sizes.append(out.numel())
    )
    budget = 2 * BATCH * BLOCK * TINY_VOCAB
    step.max_chunk_logits = budget
    step(inputs).loss.backward()
    hook.remove()
    chunks = -(-n_blocks // 2)
    # Forward once per chunk, then each chunk's logits recomputed once during backward.
    assert len(sizes) == 2 * chunks
    assert max(sizes) <= budget


def test_combine_losses_weights_chunks_by_their_supervision(tmp_path: Path) -> None:
    """A plain mean of chunk losses is wrong when chunks supervise different amounts."""
    objective = tiny_plan(tmp_path).draft.objective
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, BLOCK, 11, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (1, 4, BLOCK), generator=gen)
    mask = torch.ones(1, 4, BLOCK, dtype=torch.bool)
    mask[0, 0, 2:] = False  # block 0 supervises one position, the others three
    whole = dflash_loss(logits, labels, mask, objective=objective)
    parts = [
        dflash_loss(
            logits[:, i : i + 2], labels[:, i : i + 2], mask[:, i : i + 2], objective=objective
        )
        for i in (0, 2)
    ]
    combined = combine_losses(parts)
    torch.testing.assert_close(combined.loss, whole.loss)
    torch.testing.assert_close(combined.weight_sum, whole.weight_sum)
    naive = (parts[0].loss + parts[1].loss) / 2
    assert not torch.allclose(naive, whole.loss)
    with pytest.raises(ValueError, match="at least one chunk"):
        combine_losses([])


class _WeightReads(TorchDispatchMode):
    """Records the name of every aten op that reads `weight`'s storage, with its operands' dims."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.storage = weight.untyped_storage().data_ptr()
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, Tensor)]
        if any(t.untyped_storage().data_ptr() == self.storage for t in tensors):
            self.ops.append((func.overloadpacket.__name__, tuple(t.dim() for t in tensors)))
        return func(*args, **(kwargs or {}))


_VIEWS = {"t", "transpose", "view", "_unsafe_view", "expand", "detach", "alias", "as_strided"}


@pytest.mark.parametrize("batch", [1, BATCH])
@pytest.mark.parametrize("blocks", [None, 2])
def test_lm_head_is_one_2d_gemm_per_chunk(tmp_path: Path, batch: int, blocks: int | None) -> None:
    """The vocabulary matrix is read by one mm per chunk (forward, recompute, input gradient),
    never by a batched matmul over blocks (a chunk is a strided view of the step's states)."""
    plan = tiny_plan(tmp_path, block_size=BLOCK)
    step, inputs = _step_inputs(plan, rows=batch)
    n_blocks = inputs.targets.labels.shape[1]
    if blocks is not None:
        step.max_chunk_logits = blocks * batch * BLOCK * TINY_VOCAB
    chunks = -(-n_blocks // step.blocks_per_chunk(batch, n_blocks))
    weight = step._lm_head.weight  # type: ignore[union-attr]
    with _WeightReads(weight) as reads:
        step(inputs).loss.backward()
    compute = [(name, dims) for name, dims in reads.ops if name not in _VIEWS]
    assert all(name == "mm" and dims == (2, 2) for name, dims in compute), compute
    # chunked: forward, the checkpoint's recompute and the input gradient; whole: no recompute
    assert len(compute) == (3 * chunks if chunks > 1 else 2)


@pytest.mark.parametrize("teacher", [False, True])
def test_the_target_stops_after_the_deepest_tap_unless_a_teacher_needs_it(
    tmp_path: Path, teacher: bool
) -> None:
    plan = tiny_plan(tmp_path, block_size=BLOCK, self_logit_distillation=teacher)
    model = convert(tiny_target(plan), plan)
    spec = plan.resolved_draft()
    layers = model.get_decoder().layers
    assert max(spec.target_layer_ids) < len(layers) - 1  # taps (1, 2) of 4 layers
    calls: list[int] = []
    for k, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_, k=k: calls.append(k))
    ids = torch.randint(0, spec.mask_token_id, (1, 24), generator=torch.Generator().manual_seed(1))
    ones = torch.ones_like(ids)
    gen = torch.Generator().manual_seed(2)
    drawn = sample_anchors(ones, ones, block_size=BLOCK, num_anchors=3, generator=gen)
    batch = Batch(ids, ones, ones, epoch=0, next_index=1)
    step_inputs(model, spec, plan.draft.objective, batch, drawn, step=0, total_steps=1)
    deepest = len(layers) - 1 if teacher else max(spec.target_layer_ids)
    assert calls == list(range(deepest + 1))
