"""DFlash 2's torch parts against references written from the reference's formulas (issue 37).

The convolution reference below reads only the parameters and the formula of reference section
3 (x~_j[c] = sum_{t<K} (beta[s,t,c] + delta_j[s,t,c // group]) * u_{j-t}[c], with the tap read as
zero when j mod B < t), one channel at a time, and never calls the module's own helpers.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from testkit.tiny import randomize, tiny_plan
from torch import Tensor

from dflash_recipes.executor.kinds.dflash import dflash_loss
from dflash_recipes.executor.kinds.dflash2 import (
    MODULES,
    CandidateSelector,
    DFlash2Settings,
    GroupedDynamicCausalConv,
    SelectorHead,
    edge_scores,
    select_path,
    selector_loss,
    selector_path,
    unary_scores,
)
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.executor.model.masks import build_dense_block_mask
from dflash_recipes.executor.model.warmstart import load_init_checkpoint
from dflash_recipes.executor.training.anchors import block_positions
from dflash_recipes.executor.training.loss import ObjectiveInputs, combine_losses
from dflash_recipes.plan.parts import InitCheckpointPlan

BLOCK = 4
CTX = 14
ANCHORS = torch.tensor([[3, 7, 10], [0, 5, 0]])
VALID = torch.tensor([[True, True, True], [True, True, False]])
SETTINGS = DFlash2Settings(
    conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4
)


def reference_conv(
    x: Tensor, u: Tensor, base: Tensor, projection: Tensor, side: int, block: int, group: int
) -> Tensor:
    """Side `side` of the convolution of x [S, H], coefficients from u [S, H], by the formula."""
    seq, hidden = x.shape
    kernel = base.shape[1]
    groups = hidden // group
    out = torch.zeros_like(x)
    for j in range(seq):
        delta = (projection @ u[j]).view(2, kernel, groups)
        for c in range(hidden):
            for t in range(kernel):
                if j % block < t:
                    continue  # the tap reaches before the block's start: zero padding
                out[j, c] += (base[side, t, c] + delta[side, t, c // group]) * x[j - t, c]
    return out


def random_conv(hidden: int = 8, kernel: int = 3, group: int = 4) -> GroupedDynamicCausalConv:
    conv = GroupedDynamicCausalConv(hidden, kernel, group)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    return conv


def test_conv_matches_the_formula_on_both_sides() -> None:
    torch.manual_seed(0)
    conv = random_conv()
    u, o = torch.randn(2, 8, 8), torch.randn(2, 8, 8)
    coeff = conv.coefficients(u)
    w = conv.kernel_projection.weight
    for b in range(2):
        for side, x in ((0, u), (1, o)):
            expected = reference_conv(x[b], u[b], conv.base_kernel, w, side, 4, 4)
            got = conv.apply_side(x, coeff, side, block_size=4)[b]
            torch.testing.assert_close(got, expected)
    # the whole sublayer sandwich: post(sublayer(pre(u))), both sides with u's coefficients
    sublayer = torch.nn.Linear(8, 8)
    got = conv(u, sublayer, 4)
    for b in range(2):
        pre = reference_conv(u[b], u[b], conv.base_kernel, w, 0, 4, 4)
        expected = reference_conv(sublayer(pre), u[b], conv.base_kernel, w, 1, 4, 4)
        torch.testing.assert_close(got[b], expected)


def test_conv_taps_stop_at_block_starts() -> None:
    torch.manual_seed(1)
    conv = random_conv()
    u = torch.randn(1, 8, 8)
    coeff = conv.coefficients(u)
    got = conv.apply_side(u, coeff, 0, block_size=4)
    # position 0 of a block (the anchor) sees only zero padding besides itself ...
    torch.testing.assert_close(got[:, 4], coeff[:, 4, 0, 0] * u[:, 4])
    # ... and position 1 sees the anchor
    torch.testing.assert_close(got[:, 5], coeff[:, 5, 0, 0] * u[:, 5] + coeff[:, 5, 0, 1] * u[:, 4])
    # nothing of block 0 reaches block 1
    changed = u.clone()
    changed[:, :4] += 100.0
    coeff2 = conv.coefficients(changed)
    torch.testing.assert_close(conv.apply_side(changed, coeff2, 0, 4)[:, 4:], got[:, 4:])


def test_conv_refuses_a_stream_that_is_not_whole_blocks() -> None:
    conv = random_conv()
    with pytest.raises(ValueError, match="not whole blocks of 4"):
        conv(torch.randn(1, 6, 8), torch.nn.Identity(), 4)


def test_fresh_conv_is_the_identity() -> None:
    conv = GroupedDynamicCausalConv(hidden=8, kernel=2, group_size=2)
    u = torch.randn(1, 8, 8)
    assert torch.equal(conv(u, torch.nn.Identity(), 4), u)


def _inputs(hidden: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(3)
    batch, n_blocks = ANCHORS.shape
    return (
        torch.randn(batch, n_blocks * BLOCK, hidden, generator=gen),
        torch.randn(batch, CTX, hidden, generator=gen),
        block_positions(ANCHORS, BLOCK),
        torch.arange(CTX).expand(batch, CTX),
    )


def _forward(model: DFlashDraftModel, embeds: Tensor, context: Tensor) -> Tensor:
    _, _, q_pos, ctx_pos = _inputs(model.spec.hidden_size)
    mask = build_dense_block_mask(ANCHORS, BLOCK, CTX, VALID)
    with torch.no_grad():
        out: Tensor = model(embeds, context, q_pos, ctx_pos, mask)
    return out


#: The tiny plan's DFlash 2 fields (SETTINGS).
D2_FIELDS: dict[str, object] = {
    "projector_type": "dflash2",
    "conv_kernel_size": SETTINGS.conv_kernel_size,
    "conv_group_size": SETTINGS.conv_group_size,
    "selector_rank": SETTINGS.selector_rank,
    "selector_top_k": SETTINGS.selector_top_k,
}


def _model(tmp_path: Path, seed: int = 0) -> DFlashDraftModel:
    plan = tiny_plan(tmp_path, block_size=BLOCK, rope_theta=10_000.0, **D2_FIELDS)
    model = DFlashDraftModel(plan.resolved_draft())
    randomize(model, seed)
    return model


def test_every_sublayer_has_the_conv_on_both_sides(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _model(tmp_path)
    embeds, context, q_pos, ctx_pos = _inputs(model.spec.hidden_size)
    got = _forward(model, embeds, context)
    mask = build_dense_block_mask(ANCHORS, BLOCK, CTX, VALID)
    positions = torch.cat([ctx_pos, q_pos], dim=1)
    cos, sin = model.rotary_emb(embeds, positions)
    group = SETTINGS.conv_group_size

    def sandwich(conv: GroupedDynamicCausalConv, u: Tensor, sublayer: object) -> Tensor:
        rows = []
        for b in range(u.shape[0]):
            base, w = conv.base_kernel, conv.kernel_projection.weight
            pre = reference_conv(u[b], u[b], base, w, 0, BLOCK, group)
            out = sublayer(pre.unsqueeze(0), b)  # type: ignore[operator]
            rows.append(reference_conv(out[0], u[b], base, w, 1, BLOCK, group))
        return torch.stack(rows)

    with torch.no_grad():
        x = embeds
        for layer in model.layers:
            u = layer.input_layernorm(x)
            x = x + sandwich(
                layer.attention_conv,
                u,
                lambda v, b, attn=layer.self_attn: attn(
                    v, context[b : b + 1], cos[b : b + 1], sin[b : b + 1], mask[b : b + 1]
                ),
            )
            u = layer.post_attention_layernorm(x)
            x = x + sandwich(layer.mlp_conv, u, lambda v, b, mlp=layer.mlp: mlp(v))
        expected = model.norm(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_state_dict_has_the_dflash2_names(tmp_path: Path) -> None:
    model = _model(tmp_path)
    names = set(model.state_dict())
    assert "layers.1.mlp_conv.kernel_projection.weight" in names
    assert "layers.0.attention_conv.base_kernel" in names
    assert "candidate_selector.predecessor_codebook" in names
    assert "candidate_selector.successor_codebook" in names
    assert not any(n.endswith("codebook.weight") for n in names)
    groups = model.spec.hidden_size // SETTINGS.conv_group_size
    shape = tuple(model.state_dict()["layers.0.mlp_conv.kernel_projection.weight"].shape)
    assert shape == (2 * 2 * groups, model.spec.hidden_size)


# --- the candidate selector --------------------------------------------------------------------


def _hand_selector() -> CandidateSelector:
    """V 4, r 2, H 2: W = I, A = [[1,0],[0,1],[1,1],[0,0]], B = [[0,0],[2,0],[0,3],[1,1]]."""
    sel = CandidateSelector(hidden=2, vocab=4, rank=2)
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(torch.eye(2))
        sel.predecessor_codebook.copy_(torch.tensor([[1.0, 0], [0, 1], [1, 1], [0, 0]]))
        sel.successor_codebook.copy_(torch.tensor([[0.0, 0], [2, 0], [0, 3], [1, 1]]))
    return sel


def test_edge_scores_by_hand() -> None:
    sel = _hand_selector()
    h = torch.tensor([1.0, 2.0])
    unary = torch.tensor([0.5, 0.25, 0.0])
    cands = torch.tensor([1, 2, 3])
    # p = 0: A[0] * W h = [1, 0] -> <., B[1]> = 2, B[2] -> 0, B[3] -> 1
    got = sel.edge_scores(unary, cands, torch.tensor(0), h)
    assert got.tolist() == [2.5, 0.25, 1.0]
    # p = 2: A[2] * W h = [1, 2] -> B[1] 2, B[2] 6, B[3] 3
    got = sel.edge_scores(unary, cands, torch.tensor(2), h)
    assert got.tolist() == [2.5, 6.25, 3.0]
    # batched, two slots at once
    both = edge_scores(
        torch.stack([unary, unary]),
        torch.stack([cands, cands]),
        torch.tensor([0, 2]),
        torch.stack([h, h]),
        sel.hidden_projection.weight,
        sel.predecessor_codebook,
        sel.successor_codebook,
    )
    assert both.tolist() == [[2.5, 0.25, 1.0], [2.5, 6.25, 3.0]]


def test_greedy_path_by_hand() -> None:
    sel = _hand_selector()
    # slot 0: top-2 of the unary is {1: 1.0, 0: 0.9}; from anchor 2 (A = [1, 1]) with h = [1, 0]
    # the query is [1, 0]: token 1 scores 1.0 + 2 = 3.0, token 0 scores 0.9 -> token 1.
    # slot 1: top-2 {3: 2.0, 2: 1.5}; from token 1 (A = [0, 1]) with h = [0, 1] the query is
    # [0, 1]: token 3 scores 2.0 + 1 = 3.0, token 2 scores 1.5 + 3 = 4.5 -> token 2 (the unary
    # argmax would pick 3).
    unary = torch.tensor([[0.9, 1.0, 0.0, -1.0], [0.0, 0.0, 1.5, 2.0]])
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    w, a, b = sel.hidden_projection.weight, sel.predecessor_codebook, sel.successor_codebook
    assert selector_path(unary, hidden, 2, 2, w, a, b) == [1, 2]
    batched = select_path(unary[None], hidden[None], torch.tensor([2]), 2, sel)
    assert batched.tolist() == [[1, 2]]
    # top-1 is the unary argmax path whatever the codebooks say
    assert selector_path(unary, hidden, 2, 1, w, a, b) == [1, 3]
    # from anchor 3 (A = 0) slot 0's pair terms vanish (token 1 by its unary score); slot 1's
    # predecessor is still the chosen token 1, so token 2 again
    assert selector_path(unary, hidden, 3, 2, w, a, b) == [1, 2]
    # from anchor 0 (A = [1, 0]), slot 0: token 1 scores 1.0 + 2 = 3.0 -> 1; the same slot 1
    assert selector_path(unary, hidden, 0, 2, w, a, b) == [1, 2]
    # batched: three blocks with the same slots and anchors 2, 3, 0
    three = select_path(
        unary.expand(3, -1, -1), hidden.expand(3, -1, -1), torch.tensor([2, 3, 0]), 2, sel
    )
    assert three.tolist() == [[1, 2]] * 3


def test_a_zero_successor_codebook_is_the_unary_argmax_path() -> None:
    torch.manual_seed(1)
    sel = CandidateSelector(hidden=4, vocab=6, rank=3)
    unary, hidden = torch.randn(3, 5, 6), torch.randn(3, 5, 4)
    path = select_path(unary, hidden, torch.tensor([0, 1, 2]), 3, sel)
    assert torch.equal(path, unary.argmax(-1))


def test_unary_scores_multiplier_and_softcap() -> None:
    logits = torch.tensor([10.0, -4.0], dtype=torch.bfloat16)
    plain = unary_scores(logits, SETTINGS)
    assert plain.dtype == torch.float32 and plain.tolist() == [10.0, -4.0]
    # float32 logits with the defaults are the unary scores themselves: no logits-sized copy
    as_float = logits.float()
    assert unary_scores(as_float, SETTINGS) is as_float
    capped = DFlash2Settings(2, 16, 8, 4, output_multiplier=0.5, final_logit_softcapping=2.0)
    got = unary_scores(logits, capped).tolist()
    assert got == pytest.approx([2 * math.tanh(2.5), 2 * math.tanh(-1.0)])


# --- DFlash 1 -> DFlash 2 at step 0 ------------------------------------------------------------


def test_a_dflash2_drafter_warm_started_from_a_dflash1_one_computes_exactly_the_same(
    tmp_path: Path,
) -> None:
    """The real warm start: a DFlash 1 export loads into the DFlash 2 backbone, the new parts
    start as the identity and a zero successor codebook, and the outputs are equal bit for bit."""
    plan = tiny_plan(tmp_path / "d1", block_size=BLOCK, rope_theta=10_000.0)
    dflash = DFlashDraftModel(plan.resolved_draft())
    randomize(dflash, seed=4)
    export_drafter(dflash, plan, tmp_path / "export", dtype="float32")
    init = InitCheckpointPlan(
        path=str(tmp_path / "export"),
        heads_from_scratch=("attention_conv", "mlp_conv", "candidate_selector"),
    )
    plan2 = tiny_plan(
        tmp_path / "d2", block_size=BLOCK, rope_theta=10_000.0, init_checkpoint=init, **D2_FIELDS
    )
    torch.manual_seed(0)
    model = DFlashDraftModel(plan2.resolved_draft())
    report = load_init_checkpoint(model, plan2)
    assert report.tensors_loaded == len(dflash.state_dict())
    for name, tensor in dflash.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    embeds, context, _, _ = _inputs(dflash.spec.hidden_size)
    hidden = _forward(model, embeds, context)
    assert torch.equal(hidden, _forward(dflash, embeds, context))  # bit for bit, float32
    # the selector's greedy path is DFlash 1's argmax path
    lm_head = torch.randn(dflash.spec.vocab_size, dflash.spec.hidden_size)
    slots = hidden.view(-1, BLOCK, hidden.shape[-1])[:, 1:]
    # unary gaps made tiny, so any pair term the fresh selector added would change the path
    unary = unary_scores(slots @ lm_head.T, SETTINGS) * 1e-6
    anchors = torch.arange(slots.shape[0]) % dflash.spec.vocab_size
    selector = model.candidate_selector
    assert isinstance(selector, CandidateSelector)
    path = select_path(unary, slots, anchors, SETTINGS.selector_top_k, selector)
    assert torch.equal(path, unary.argmax(-1))
    assert not torch.equal(selector.predecessor_codebook, torch.zeros(1))


def test_a_dflash2_checkpoint_warm_starts_every_tensor_bit_for_bit(tmp_path: Path) -> None:
    """A DFlash 2 export (bfloat16, as released) loads whole: convolutions and selector too."""
    plan = tiny_plan(tmp_path / "a", block_size=BLOCK, **D2_FIELDS)
    source = DFlashDraftModel(plan.resolved_draft())
    randomize(source, seed=7)
    export_drafter(source, plan, tmp_path / "export", dtype="bfloat16")
    init = InitCheckpointPlan(path=str(tmp_path / "export"))
    plan2 = tiny_plan(tmp_path / "b", block_size=BLOCK, init_checkpoint=init, **D2_FIELDS)
    model = DFlashDraftModel(plan2.resolved_draft())
    report = load_init_checkpoint(model, plan2)
    assert report.tensors_loaded == len(model.state_dict()) and report.dtypes == ("BF16",)
    assert report.heads_from_scratch == ()
    for name, tensor in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor.bfloat16().float()), name
    assert model.state_dict()["candidate_selector.successor_codebook"].any()


def test_a_fresh_dflash2_drafter_has_identity_convolutions_and_a_zero_successor_codebook(
    tmp_path: Path,
) -> None:
    """The drafter's own initialisation draws every linear from a normal; the kind's layers then
    reset their convolutions to the identity (a projection left random would not be)."""
    plan = tiny_plan(tmp_path, block_size=BLOCK, **D2_FIELDS)
    model = DFlashDraftModel(plan.resolved_draft(), generator=torch.Generator().manual_seed(3))
    state = model.state_dict()
    for i in range(model.spec.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            assert not state[f"layers.{i}.{conv}.kernel_projection.weight"].any()
            base = state[f"layers.{i}.{conv}.base_kernel"]
            assert base[:, 0].eq(1).all() and not base[:, 1:].any()
    assert not state["candidate_selector.successor_codebook"].any()
    assert state["candidate_selector.predecessor_codebook"].std() > 0.01
    assert state["layers.0.self_attn.q_proj.weight"].std() > 0.01


# --- the selector's loss -----------------------------------------------------------------------


def _loss_case() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Three positions on the hand selector (see test_greedy_path_by_hand for the edges)."""
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    unary = torch.tensor([[0.9, 1.0, 0.0, -1.0], [0.0, 0.0, 1.5, 2.0], [0.0, 0.0, 1.5, 2.0]])
    prev = torch.tensor([2, 1, 1])
    gold = torch.tensor([0, 2, 0])  # position 2's gold is not in its top-2 {3, 2}
    return hidden, unary, prev, gold


def _ce(edges: list[float], gold: int) -> float:
    return math.log(sum(math.exp(e) for e in edges)) - edges[gold]


def test_selector_loss_by_hand_skips_a_missing_gold_token() -> None:
    sel = _hand_selector()
    hidden, unary, prev, gold = _loss_case()
    weights = torch.tensor([1.0, 0.5, 1.0])
    got = selector_loss(sel, hidden, unary, prev, gold, weights, 2)
    # position 0: candidates [1, 0], edges [3.0, 0.9], gold 0; position 1: [3, 2], [3.0, 4.5],
    # gold 2; position 2: skipped, but its weight stays in the denominator
    expected = (_ce([3.0, 0.9], 1) + 0.5 * _ce([3.0, 4.5], 1)) / 2.5
    assert float(got.loss.detach()) == pytest.approx(expected)
    assert (int(got.count), int(got.counted), int(got.correct)) == (3, 2, 1)


def test_selector_loss_by_hand_injects_a_missing_gold_token() -> None:
    sel = _hand_selector()
    hidden, unary, prev, gold = _loss_case()
    weights = torch.tensor([1.0, 0.5, 1.0])
    got = selector_loss(sel, hidden, unary, prev, gold, weights, 2, "inject")
    # position 2: gold 0 replaces candidate 2: candidates [3, 0], edges [3.0, 0.0 + 0]
    expected = (_ce([3.0, 0.9], 1) + 0.5 * _ce([3.0, 4.5], 1) + _ce([3.0, 0.0], 1)) / 2.5
    assert float(got.loss.detach()) == pytest.approx(expected)
    # an injected token is never counted as a correct choice (serving cannot pick it)
    assert (int(got.count), int(got.counted), int(got.correct)) == (3, 3, 1)
    # top-1: position 1's gold 2 replaces candidate 3 and is the only (so chosen) candidate
    one = selector_loss(sel, hidden, unary, prev, gold, weights, 1, "inject")
    assert (int(one.count), int(one.counted), int(one.correct)) == (3, 3, 0)


def test_selector_loss_ignores_unweighted_positions_and_trains_the_selector() -> None:
    sel = _hand_selector()
    hidden, unary, prev, gold = _loss_case()
    got = selector_loss(
        sel, hidden, unary, prev, torch.tensor([0, 2, 3]), torch.tensor([1.0, 0.5, 0.0]), 2
    )
    assert (int(got.count), int(got.counted), int(got.correct)) == (2, 2, 1)
    expected = (_ce([3.0, 0.9], 1) + 0.5 * _ce([3.0, 4.5], 1)) / 1.5
    assert float(got.loss.detach()) == pytest.approx(expected)
    got.loss.backward()
    assert sel.successor_codebook.grad is not None and sel.successor_codebook.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="skip or inject"):
        selector_loss(sel, hidden, unary, prev, gold, torch.ones(3), 2, "insert")  # type: ignore[arg-type]


# --- the kind's objective: unary + alpha x selector ----------------------------------------------


def _objective_case(
    tmp_path: Path, **fields: object
) -> tuple[SelectorHead, Tensor, Tensor, Tensor, ObjectiveInputs]:
    """A tiny DFlash 2 head (a random selector, successor codebook included) and one chunk
    [B 2, n 3, K 4]."""
    plan = tiny_plan(tmp_path, block_size=BLOCK, **{**D2_FIELDS, **fields})
    model = DFlashDraftModel(plan.resolved_draft())
    head = model.head
    assert isinstance(head, SelectorHead)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # pair terms as large as the unary gaps
        for param in head.candidate_selector.parameters():
            param.normal_(std=1.0, generator=gen)
    spec = model.spec
    hidden = torch.randn(2, 3, BLOCK, spec.hidden_size, generator=gen)
    logits = torch.randn(2, 3, BLOCK, spec.vocab_size, generator=gen) * 3
    ids = torch.randint(0, spec.vocab_size, (2, 20), generator=gen)
    anchors = torch.tensor([[2, 8, 14], [0, 5, 16]])
    labels = torch.stack([ids[b, anchors[b, :, None] + torch.arange(BLOCK)] for b in range(2)])
    label_mask = torch.ones_like(labels, dtype=torch.bool)
    label_mask[1, 2, 2:] = False  # the end of a sequence
    labels = torch.where(label_mask, labels, -100)
    (prev,) = MODULES.head_inputs(spec, ids, anchors, torch.nn.Embedding(1, 1))
    targets = ObjectiveInputs(labels, label_mask, None, step=0, total_steps=1)
    return head, hidden, logits, prev, targets


def test_the_objective_is_the_unary_loss_plus_alpha_times_the_selector_loss(
    tmp_path: Path,
) -> None:
    head, hidden, logits, prev, targets = _objective_case(
        tmp_path, output_multiplier=0.5, final_logit_softcapping=4.0
    )
    objective = tiny_plan(tmp_path, selector_loss_alpha=0.25).draft.objective
    out = MODULES.objective(head, hidden, logits, (prev,), targets, objective)
    # the unary term: plain DFlash's loss of the unary scores (multiplier and soft cap applied)
    unary = unary_scores(logits, head.settings)
    plain = dflash_loss(unary, targets.labels, targets.label_mask, objective=objective)
    assert float(out.ce) == pytest.approx(float(plain.ce))
    assert not torch.isclose(
        plain.ce, dflash_loss(logits, targets.labels, targets.label_mask, objective=objective).ce
    )
    # the selector term, on the scored positions (k >= 1, supervised), DFlash's decay weights
    scored = targets.label_mask.clone()
    scored[..., 0] = False
    weights = torch.exp(-(torch.arange(BLOCK) - 1) / objective.loss_decay_factor)
    w = torch.broadcast_to(weights, scored.shape)[scored]
    # the predecessor of position k is the label of position k - 1 (k = 1: the anchor)
    assert torch.equal(
        prev[..., 1:][scored[..., 1:]],
        targets.labels[..., :-1][scored[..., 1:]],
    )
    sel = selector_loss(
        head.candidate_selector,
        hidden[scored],
        unary[scored],
        prev[scored],
        targets.labels[scored],
        w,
        SETTINGS.selector_top_k,
    )
    assert float(out.parts["selector_ce"]) == pytest.approx(float(sel.loss.detach()))
    assert float(out.loss.detach()) == pytest.approx(
        float(plain.loss) + 0.25 * float(sel.loss.detach())
    )
    assert int(out.position_correct["selector"].sum()) == int(sel.correct)
    assert int(out.position_correct["selector"][0]) == 0  # the anchor is never scored


def test_the_objective_combines_over_chunks_exactly_and_trains_the_selector(
    tmp_path: Path,
) -> None:
    head, hidden, logits, prev, targets = _objective_case(tmp_path)
    objective = tiny_plan(tmp_path, loss_objective="dpace").draft.objective
    hidden.requires_grad_(True)
    whole = MODULES.objective(head, hidden, logits, (prev,), targets, objective)
    parts = []
    for first, end in ((0, 1), (1, 3)):
        chunk = ObjectiveInputs(
            targets.labels[:, first:end], targets.label_mask[:, first:end], None, 0, 1
        )
        parts.append(
            MODULES.objective(
                head,
                hidden[:, first:end],
                logits[:, first:end],
                (prev[:, first:end],),
                chunk,
                objective,
            )
        )
    combined = combine_losses(parts)
    torch.testing.assert_close(combined.loss, whole.loss)
    torch.testing.assert_close(combined.parts["selector_ce"], whole.parts["selector_ce"])
    assert torch.equal(combined.position_correct["selector"], whole.position_correct["selector"])
    whole.loss.backward()
    grad = head.candidate_selector.successor_codebook.grad
    assert grad is not None and grad.abs().sum() > 0
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_alpha_zero_leaves_the_unary_loss_and_no_selector_gradient(tmp_path: Path) -> None:
    head, hidden, logits, prev, targets = _objective_case(tmp_path)
    objective = tiny_plan(tmp_path, selector_loss_alpha=0.0).draft.objective
    out = MODULES.objective(head, hidden, logits, (prev,), targets, objective)
    plain = dflash_loss(logits, targets.labels, targets.label_mask, objective=objective)
    torch.testing.assert_close(out.loss, plain.loss)
    assert float(out.parts["selector_ce"]) > 0  # still measured
    out.loss.backward()
    grad = head.candidate_selector.successor_codebook.grad
    assert grad is None or not grad.any()


def test_proposals_are_the_selectors_greedy_path_from_the_anchor(tmp_path: Path) -> None:
    head, hidden, logits, _, _ = _objective_case(tmp_path)
    spec = tiny_plan(tmp_path, block_size=BLOCK, **D2_FIELDS).resolved_draft()
    rows_hidden, rows_logits = hidden[0], logits[0]  # three blocks as three rows
    anchors = [7, 11, 2]
    got = MODULES.propose(head, rows_hidden, rows_logits, anchors, spec, torch.nn.Embedding(1, 1))
    sel = head.candidate_selector
    for r in range(3):
        expected = selector_path(
            unary_scores(rows_logits[r, 1:], head.settings),
            rows_hidden[r, 1:],
            anchors[r],
            SETTINGS.selector_top_k,
            sel.hidden_projection.weight,
            sel.predecessor_codebook,
            sel.successor_codebook,
        )
        assert got[r].tolist() == expected
    # the random successor codebook changes at least one proposal against the unary argmax
    assert not torch.equal(got, rows_logits[:, 1:].argmax(-1))


def test_the_objective_of_a_drafter_built_for_another_kind_is_refused(tmp_path: Path) -> None:
    _, hidden, logits, prev, targets = _objective_case(tmp_path)
    objective = tiny_plan(tmp_path).draft.objective
    with pytest.raises(TypeError, match="expected a DFlash 2 head"):
        MODULES.objective(None, hidden, logits, (prev,), targets, objective)


def test_input_embedding_scale_multiplies_the_block_embeddings(tmp_path: Path) -> None:
    scaled = DFlashDraftModel(
        tiny_plan(
            tmp_path, block_size=BLOCK, rope_theta=10_000.0, input_embedding_scale=1.7, **D2_FIELDS
        ).resolved_draft()
    )
    randomize(scaled, seed=2)
    plain = DFlashDraftModel(
        tiny_plan(tmp_path, block_size=BLOCK, rope_theta=10_000.0, **D2_FIELDS).resolved_draft()
    )
    plain.load_state_dict(scaled.state_dict())
    embeds, context, _, _ = _inputs(scaled.spec.hidden_size)
    torch.testing.assert_close(
        _forward(scaled, embeds, context), _forward(plain, embeds * 1.7, context)
    )
    assert not torch.allclose(_forward(scaled, embeds, context), _forward(plain, embeds, context))
