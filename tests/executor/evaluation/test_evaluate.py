"""Pooled tau versus the mean of per-prompt taus (issue 11): both reported, each named."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from testkit.tiny import MAX_NEW, PROMPTS, randomize, tiny_plan, tiny_target
from torch import Tensor
from transformers import PreTrainedModel

from dflash_recipes.executor.evaluation.evaluate import evaluate_acceptance
from dflash_recipes.executor.evaluation.speculative import (
    DFlashBlockDrafter,
    DraftContext,
    as_block_drafter,
    greedy_generate,
)
from dflash_recipes.executor.kinds.domino import domino_head
from dflash_recipes.executor.kinds.dspark import dspark_head
from dflash_recipes.executor.model.convert import embed_tokens, lm_head
from dflash_recipes.executor.model.draft import DFlashDraftModel, taps_from_hidden_states

pytestmark = pytest.mark.usefixtures("one_thread")


class PerPromptOracle:
    """Proposes the target's greedy tokens for a given number of block positions per prompt."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], correct: list[int]):
        self.continuations = continuations
        self.correct = dict(zip(continuations, correct, strict=True))

    def propose(self, context: DraftContext) -> list[int]:
        committed = list(context.committed)
        prompt = next(p for p in self.continuations if committed[: len(p)] == list(p))
        full = [*prompt, *self.continuations[prompt]]
        right = full[len(committed) : len(committed) + context.block_size - 1]
        good = self.correct[prompt]
        return [t if k < good else (t + 1) % 100 for k, t in enumerate(right)]


def test_pooled_and_per_prompt_mean_tau_differ_and_are_both_reported(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, block_size=4)
    spec = plan.resolved_draft()
    target: PreTrainedModel = tiny_target(plan)
    randomize(target, seed=1)
    prompts = [list(p) for p in PROMPTS]
    continuations = {
        tuple(p): greedy_generate(target, p, MAX_NEW + spec.block_size, None) for p in prompts
    }
    # prompt 0: every proposal right (tau 4 per step); prompts 1 and 2: none (tau 1 per step)
    oracle = PerPromptOracle(continuations, [3, 0, 0])
    report = evaluate_acceptance(
        target, oracle, spec, prompts, max_new_tokens=MAX_NEW, eos_token_id=None
    )
    fast_steps = math.ceil((MAX_NEW - 1) / 4)
    slow_steps = MAX_NEW - 1
    pooled = (4 * fast_steps + 2 * slow_steps) / (fast_steps + 2 * slow_steps)
    assert report.lossless
    assert report.tau_per_prompt == [4.0, 1.0, 1.0]
    assert report.tau_per_prompt_mean == pytest.approx(2.0)
    assert report.tau == report.tau_pooled == pytest.approx(pooled)
    assert report.tau_pooled < 1.5 < report.tau_per_prompt_mean  # long, slow prompts weigh more

    row = report.to_dict()
    assert row["tau"] == row["tau_pooled"] == pytest.approx(pooled)
    assert row["tau_per_prompt_mean"] == pytest.approx(2.0)
    assert row["tau_per_prompt"] == [4.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------------------
# heads: drafted as the serving engine applies them, lossless, and named in the report
# ---------------------------------------------------------------------------------------------

HEADS: list[dict[str, object]] = [
    {},
    {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8},
    {"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8, "pure_draft_prefix_len": 2},
    {
        "projector_type": "domino",
        "emb_dim": 16,
        "gru_hidden_dim": 8,
        "shift_label": False,
        "pure_draft_prefix_len": 0,
    },
    {"projector_type": "dspark", "markov_rank": 4},
    {"projector_type": "dspark", "markov_rank": 4, "markov_head_type": "gated"},
    {
        "projector_type": "dspark",
        "markov_rank": 4,
        "markov_head_type": "rnn",
        "use_confidence_head": True,
    },
]


def _head_drafter(tmp_path: Path, overrides: dict[str, object]):  # type: ignore[no-untyped-def]
    plan = tiny_plan(tmp_path, block_size=4, **overrides)
    spec = plan.resolved_draft()
    target: PreTrainedModel = tiny_target(plan)
    randomize(target, seed=1)
    drafter = DFlashDraftModel(spec)
    randomize(drafter, seed=5)
    return spec, target, drafter.eval()


@pytest.mark.parametrize("overrides", HEADS, ids=lambda o: repr(sorted(o.items())))
def test_eval_with_each_head_is_lossless_and_names_the_head(
    tmp_path: Path, overrides: dict[str, object]
) -> None:
    spec, target, drafter = _head_drafter(tmp_path, overrides)
    prompts = [list(p) for p in PROMPTS]
    report = evaluate_acceptance(
        target, drafter, spec, prompts, max_new_tokens=MAX_NEW, eos_token_id=None
    )
    assert report.lossless
    assert report.head == spec.head_description and report.to_dict()["head"] == report.head
    shifted = overrides.get("projector_type") and overrides.get("shift_label", True)
    assert report.drafted_tokens == (4 if shifted else 3)
    assert len(report.per_position_acceptance) == report.drafted_tokens
    assert 1.0 <= report.tau <= report.drafted_tokens + 1


def _served_domino(
    drafter: DFlashDraftModel, hidden: Tensor, base: Tensor, anchor: int, embed: torch.nn.Module
) -> list[int]:
    """SGLang's Domino rollout, written from its description (shift_label true): proposals
    0 .. prefix-1 are the backbone's argmax; then a GRU over [anchor, those proposals] gives the
    state for position `prefix`, each later proposal argmax(base + embed_proj([h ; state])) and
    advances the GRU by one token."""
    head = domino_head(drafter.head)
    prefix = head.pure_draft_prefix_len
    tokens = [int(t) for t in base[0, :prefix].argmax(-1)]
    _, state = head.prefix_gru(embed(torch.tensor([[anchor, *tokens]])).to(hidden.dtype))
    for i in range(prefix, hidden.shape[1]):
        features = torch.cat([hidden[:, i], state[0]], -1)
        token = int((base[0, i] + head.embed_proj(features)[0]).argmax())
        tokens.append(token)
        _, state = head.prefix_gru(embed(torch.tensor([[token]])).to(hidden.dtype), state)
    return tokens


def _served_dspark(
    drafter: DFlashDraftModel, hidden: Tensor, base: Tensor, anchor: int
) -> list[int]:
    """ModelOpt's DSpark rollout (pseudo_speculative_generate): position k's bias comes from the
    token decoded at k - 1 (the anchor for k = 0), one Markov step at a time."""
    head = dspark_head(drafter.head)
    prev, state, tokens = anchor, torch.zeros(1, head.markov_rank), []
    for k in range(hidden.shape[1]):
        emb = head.markov_w1(torch.tensor([prev]))
        h = hidden[:, k]
        if head.gate_proj is not None:
            latent = torch.sigmoid(head.gate_proj(torch.cat([h, emb], -1))) * emb
        elif head.joint_proj is not None:
            g, c, o = head.joint_proj(torch.cat([state, emb, h], -1)).chunk(3, -1)
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            latent = torch.tanh(o)
        else:
            latent = emb
        prev = int((base[0, k] + head.markov_w2(latent)[0]).argmax())
        tokens.append(prev)
    return tokens


@pytest.mark.parametrize("overrides", HEADS[1:3] + HEADS[4:], ids=lambda o: repr(sorted(o.items())))
def test_proposals_are_the_serving_engines_rollout(
    tmp_path: Path, overrides: dict[str, object]
) -> None:
    spec, target, drafter = _head_drafter(tmp_path, overrides)
    blocks = as_block_drafter(drafter, target, spec)
    assert isinstance(blocks, DFlashBlockDrafter)
    prompt = list(PROMPTS[0])
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
        taps = taps_from_hidden_states(out.hidden_states, spec.target_layer_ids)
        context = DraftContext(committed=tuple(prompt), taps=taps[:, :-1], block_size=4)
        hidden = blocks.draft_hidden(context)
        base = lm_head(target)(hidden)
        if spec.projector_type == "domino":
            want = _served_domino(drafter, hidden, base, prompt[-1], embed_tokens(target))
        else:
            want = _served_dspark(drafter, hidden, base, prompt[-1])
        got = blocks.propose(context)
    assert got == want and len(got) == 4
    if spec.projector_type == "domino":  # the prefix is the backbone's own argmax
        prefix = spec.pure_draft_prefix_len
        assert got[:prefix] == [int(t) for t in base[0, :prefix].argmax(-1)]
