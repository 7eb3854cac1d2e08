"""Domino and DSpark heads: tensor names, the next-token alignment, fresh heads are neutral."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testkit.tiny import TINY_VOCAB, randomize, tiny_plan

from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.heads import DominoHead, DSparkHead

N, B, H = 3, 5, 64


def test_head_submodules_sit_at_the_top_level(tmp_path: Path) -> None:
    domino = DFlashDraftModel(
        tiny_plan(tmp_path, projector_type="domino", emb_dim=16, gru_hidden_dim=8).resolved_draft()
    )
    shapes = {n: tuple(t.shape) for n, t in domino.state_dict().items()}
    assert shapes["prefix_gru.weight_ih_l0"] == (24, H)
    assert shapes["prefix_gru.weight_hh_l0"] == (24, 8)
    assert shapes["embed_proj.0.weight"] == (16, H + 8)
    assert shapes["embed_proj.2.weight"] == (TINY_VOCAB, 16)
    assert not any(n.startswith(("head.", "_head.")) for n in shapes)
    # The head object shares the module's parameters (one copy, moved and trained together).
    assert domino.domino_head.prefix_gru is domino.prefix_gru

    dspark = DFlashDraftModel(
        tiny_plan(
            tmp_path, projector_type="dspark", markov_rank=4, use_confidence_head=True
        ).resolved_draft()
    )
    shapes = {n: tuple(t.shape) for n, t in dspark.state_dict().items()}
    assert shapes["markov_w1.weight"] == (TINY_VOCAB, 4)
    assert shapes["markov_w2.weight"] == (TINY_VOCAB, 4)
    assert shapes["confidence_proj.weight"] == (1, H + 4)
    assert shapes["confidence_proj.bias"] == (1,)


def test_fresh_heads_leave_backbone_logits_unchanged() -> None:
    torch.manual_seed(0)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    domino = DominoHead(H, 8, 16, TINY_VOCAB)
    domino.reset_parameters()
    assert torch.equal(domino(hidden, torch.randn(N, B, H), base), base)
    dspark = DSparkHead(H, 4, TINY_VOCAB, use_confidence_head=False)
    dspark.reset_parameters()
    logits, confidence = dspark(hidden, torch.randint(0, TINY_VOCAB, (N, B)), base)
    assert torch.equal(logits, base) and confidence is None


@pytest.mark.parametrize(("shift", "prefix"), [(1, 1), (1, 0), (1, 3), (0, 0), (0, 2)])
def test_domino_prefix_is_uncorrected_and_position_k_sees_the_tokens_before_its_target(
    shift: int, prefix: int
) -> None:
    """Positions < pure_draft_prefix_len keep the backbone logits exactly; position k >= it is
    corrected from the GRU state over prev[first .. k] (the tokens anchor .. anchor + k + shift
    - 1) and nothing later."""
    torch.manual_seed(0)
    head = DominoHead(H, 8, 16, TINY_VOCAB, shift=shift, pure_draft_prefix_len=prefix)
    randomize(head)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    prev = torch.randn(N, B, H)
    first = 1 - shift
    with torch.no_grad():
        out = head(hidden, prev, base)
        assert torch.equal(out[:, :prefix], base[:, :prefix])
        for k in range(prefix, B):
            assert (out[:, k] - base[:, k]).abs().amax() > 1e-6, f"position {k} uncorrected"
        for j in range(B):  # perturb prev[j], the token at anchor + j + shift - 1
            moved = prev.clone()
            moved[:, j] += 1.0
            diff = (head(hidden, moved, base) - out).abs().amax(dim=(0, 2))
            for k in range(B):
                sees = k >= prefix and first <= j <= k
                assert (diff[k] > 1e-6) == sees, f"position {k}, prev index {j}"


def test_domino_computes_modelopts_correction() -> None:
    """ModelOpt 0.47 (shift_label true): gru_out = GRU(embeds of anchor + 0 .. B-1); position
    p >= prefix gets base + embed_proj([h_p ; gru_out[p]])."""
    torch.manual_seed(1)
    head = DominoHead(H, 8, 16, TINY_VOCAB, shift=1, pure_draft_prefix_len=1)
    randomize(head)
    hidden, base, prev = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB), torch.randn(N, B, H)
    with torch.no_grad():
        gru_out, _ = head.prefix_gru(prev)
        want = base[:, 1:] + head.embed_proj(torch.cat([hidden[:, 1:], gru_out[:, 1:]], -1))
        torch.testing.assert_close(head(hidden, prev, base)[:, 1:], want)


def _dspark(kind: str, shift: int = 1) -> DSparkHead:
    torch.manual_seed(2)
    head = DSparkHead(
        H, 4, TINY_VOCAB, use_confidence_head=True, markov_head_type=kind, shift=shift
    )
    randomize(head)
    return head


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_computes_modelopts_markov_bias_and_confidence(kind: str) -> None:
    """ModelOpt 0.47's DSpark heads, written out from their definitions, with prev[k] the token
    at anchor + k (shift_label true): vanilla W2(W1[x]); gated W2(sigmoid(gate_proj([h ; e]))
    * e); rnn the GRU-like recurrence of joint_proj over [s ; e ; h]; confidence
    confidence_proj([h ; W1[x]])."""
    head = _dspark(kind)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    tokens = torch.randint(0, TINY_VOCAB, (N, B))
    with torch.no_grad():
        logits, confidence = head(hidden, tokens, base)
        emb = head.markov_w1.weight[tokens]
        if kind == "vanilla":
            latent = emb
        elif kind == "gated":
            assert head.gate_proj is not None
            gate = torch.sigmoid(
                torch.cat([hidden, emb], -1) @ head.gate_proj.weight.T + head.gate_proj.bias
            )
            latent = gate * emb
        else:
            proj = head.joint_proj
            assert proj is not None
            state = torch.zeros(N, 4)
            steps = []
            for k in range(B):
                z = torch.cat([state, emb[:, k], hidden[:, k]], -1) @ proj.weight.T + proj.bias
                g, c, o = z[:, :4], z[:, 4:8], z[:, 8:]
                state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
                steps.append(torch.tanh(o))
            latent = torch.stack(steps, 1)
        torch.testing.assert_close(logits, base + latent @ head.markov_w2.weight.T)
        assert confidence is not None and head.confidence_proj is not None
        features = torch.cat([hidden, emb], -1)
        want = (features @ head.confidence_proj.weight.T + head.confidence_proj.bias)[..., 0]
        torch.testing.assert_close(confidence, want)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_position_k_sees_the_tokens_before_its_target_only(kind: str) -> None:
    head = _dspark(kind)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    tokens = torch.randint(0, TINY_VOCAB, (N, B))
    with torch.no_grad():
        out, _ = head(hidden, tokens, base)
        for j in range(B):
            moved = tokens.clone()
            moved[:, j] = (moved[:, j] + 1) % TINY_VOCAB
            diff = (head(hidden, moved, base)[0] - out).abs().amax(dim=(0, 2))
            for k in range(B):
                sees = j == k or (kind == "rnn" and j < k)
                assert (diff[k] > 1e-6) == sees, f"{kind}: position {k}, prev index {j}"


def test_dspark_without_shift_ignores_the_unused_index_0() -> None:
    head = _dspark("vanilla", shift=0)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B, TINY_VOCAB)
    tokens = torch.randint(0, TINY_VOCAB, (N, B))
    tokens[:, 0] = -100  # index 0 is unused and may hold an ignore id
    with torch.no_grad():
        logits, _ = head(hidden, tokens, base)
        w1, w2 = head.markov_w1.weight, head.markov_w2.weight
        torch.testing.assert_close(logits[:, 1:], base[:, 1:] + w1[tokens[:, 1:]] @ w2.T)


def test_gated_and_rnn_heads_have_modelopts_tensors(tmp_path: Path) -> None:
    for kind, names in (
        ("gated", {"gate_proj.weight": (4, H + 4), "gate_proj.bias": (4,)}),
        ("rnn", {"joint_proj.weight": (12, 2 * 4 + H), "joint_proj.bias": (12,)}),
    ):
        plan = tiny_plan(tmp_path, projector_type="dspark", markov_rank=4, markov_head_type=kind)
        shapes = {
            n: tuple(t.shape)
            for n, t in DFlashDraftModel(plan.resolved_draft()).state_dict().items()
        }
        assert {n: shapes[n] for n in names} == names
        assert not {"gate_proj.weight", "joint_proj.weight"} - set(names) & set(shapes)
