"""Sampled verification (temperature > 0): the rejection rule keeps the target's distribution
whatever the drafter proposes, drafts sampled or greedy; the recorder's draft distributions;
the verification loop wired to it; the settings, the CLI and the model card say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from testkit.cli_runner import cli
from testkit.tiny import PROMPTS, randomize, saved_eval_setup, tiny_plan, tiny_target
from transformers import PreTrainedModel

from dflash_recipes.card.acceptance import measurement_from_report
from dflash_recipes.card.render import _measured
from dflash_recipes.executor.evaluation.cached_decoding import speculative_generate_batch
from dflash_recipes.executor.evaluation.evaluate import evaluate_acceptance
from dflash_recipes.executor.evaluation.sampling import (
    DraftRecorder,
    Sampling,
    draw,
    verify_sampled,
)
from dflash_recipes.executor.evaluation.speculative import (
    DFlashBlockDrafter,
    DraftContext,
    as_block_drafter,
)
from dflash_recipes.executor.model.draft import DFlashDraftModel, taps_from_hidden_states
from dflash_recipes.plan.draft_spec import ResolvedDraft

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = 200_000
#: The target's logits at the proposal's position and the draft's: deliberately unlike, so
#: that a rule that accepts too much (or resamples from p instead of the residual) shows.
P_LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
Q_LOGITS = torch.tensor([-1.0, 0.0, 2.5, 1.0, 0.0])


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def proposals_from(probs: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs.expand(rows, -1), 1, generator=generator).squeeze(-1)


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=1.0),
        Sampling(temperature=0.6),
        Sampling(temperature=1.0, top_k=3),
        Sampling(temperature=1.0, top_k=4, top_p=0.8),
    ],
    ids=["t1", "t0.6", "top-k", "top-k-top-p"],
)
def test_the_first_committed_token_has_the_target_s_distribution(sampling: Sampling) -> None:
    temperature = sampling.temperature
    vocab = len(P_LOGITS)
    p = sampling.probabilities(P_LOGITS)  # cut to its top-k and top-p, when set
    q = torch.softmax(Q_LOGITS / temperature, -1)  # the draft's: any distribution will do
    proposals = proposals_from(q, ROWS, seed=1).unsqueeze(1)  # D = 1
    logits = torch.stack([P_LOGITS, P_LOGITS.flip(0)]).expand(ROWS, -1, -1)  # [R, 2, V]
    accepted, after = verify_sampled(
        proposals, q.expand(ROWS, 1, -1), logits, sampling, sampling.generator(torch.device("cpu"))
    )
    first = torch.where(accepted == 1, proposals[:, 0], after)
    assert (frequencies(first, vocab) - p.double()).abs().max() < 0.005
    # Acceptance is 1 - TV(p, q), the most any lossless rule can accept.
    assert abs(accepted.double().mean() - torch.minimum(p, q).sum()) < 0.005
    # After a fully accepted block the bonus comes from the position after it.
    bonus = frequencies(after[accepted == 1], vocab)
    assert (bonus - sampling.probabilities(P_LOGITS.flip(0)).double()).abs().max() < 0.01
    # The proposal's distribution is not the target's: accepting everything would show.
    assert (frequencies(proposals[:, 0], vocab) - p.double()).abs().max() > 0.2


def test_a_later_position_is_judged_with_the_target_s_distribution_after_the_accepted_prefix() -> (
    None
):
    """D = 2: the target's distribution at position 1 depends on the token at position 0; among
    the rows that kept proposal 0, the token committed at position 1 follows it exactly."""
    sampling = Sampling(temperature=1.0, seed=3)
    vocab = len(P_LOGITS)
    q = torch.softmax(Q_LOGITS, -1)
    table = torch.stack([P_LOGITS.roll(k) for k in range(vocab)])  # logits after token k
    proposals = torch.stack(
        [proposals_from(q, ROWS, seed=4), proposals_from(q.flip(0), ROWS, seed=5)], dim=1
    )
    draft = torch.stack([q, q.flip(0)]).expand(ROWS, -1, -1)
    logits = torch.stack(
        [P_LOGITS.expand(ROWS, -1), table[proposals[:, 0]], table[0].expand(ROWS, -1)], 1
    )
    accepted, after = verify_sampled(
        proposals, draft, logits, sampling, sampling.generator(torch.device("cpu"))
    )
    second = torch.where(accepted == 2, proposals[:, 1], after)
    for token in range(vocab):
        rows = (accepted >= 1) & (proposals[:, 0] == token)
        if int(rows.sum()) < 5_000:
            continue
        expected = torch.softmax(table[token], -1).double()
        assert (frequencies(second[rows], vocab) - expected).abs().max() < 0.02, token


def test_greedy_drafts_are_judged_as_a_point_mass() -> None:
    """--draft-sampling greedy: the argmax is proposed, accepted with probability p(x), and a
    rejection draws from p without x: the committed token still has p's distribution."""
    sampling = Sampling(temperature=1.0, seed=0, drafts="greedy")
    vocab = len(P_LOGITS)
    generator = sampling.generator(torch.device("cpu"))
    recorder = DraftRecorder(sampling, generator)
    token = recorder(Q_LOGITS.expand(ROWS, -1))
    assert (token == int(Q_LOGITS.argmax())).all()
    distributions = recorder.distributions(vocab)
    assert torch.equal(distributions[0, 0], torch.nn.functional.one_hot(token[0], vocab).float())
    logits = torch.stack([P_LOGITS, P_LOGITS]).expand(ROWS, -1, -1)
    accepted, after = recorder.verify(token.unsqueeze(1), logits)
    first = torch.where(accepted == 1, token, after)
    p = torch.softmax(P_LOGITS, -1).double()
    assert (frequencies(first, vocab) - p).abs().max() < 0.005
    assert abs(accepted.double().mean() - p[int(Q_LOGITS.argmax())]) < 0.005
    assert not (after[accepted == 0] == token[0]).any()  # a rejected token is never redrawn


def test_the_recorder_draws_among_candidates_and_records_zero_elsewhere() -> None:
    """DFlash 2's selector chooses among its top-K candidates: q is zero outside them."""
    sampling = Sampling(temperature=0.7, seed=2)
    recorder = DraftRecorder(sampling, sampling.generator(torch.device("cpu")))
    candidates = torch.tensor([[7, 3, 11], [0, 9, 4]])
    scores = torch.tensor([[1.0, 0.5, -2.0], [0.0, 3.0, 1.0]])
    tokens = recorder(scores, candidates)
    assert all(int(t) in row.tolist() for t, row in zip(tokens, candidates, strict=True))
    full = recorder(torch.randn(2, 12, generator=torch.Generator().manual_seed(0)))
    distributions = recorder.distributions(12)
    assert distributions.shape == (2, 2, 12)
    assert torch.allclose(distributions.sum(-1), torch.ones(2, 2))
    expected = torch.zeros(2, 12).scatter_(-1, candidates, torch.softmax(scores / 0.7, -1))
    assert torch.allclose(distributions[:, 0], expected)
    assert (distributions[:, 1].gather(-1, full.unsqueeze(-1)) > 0).all()
    with pytest.raises(ValueError, match="draft scores over 12 tokens, the target's 13"):
        recorder.distributions(13)


def test_top_k_then_top_p_cut_the_distribution_as_engines_do() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    full = torch.softmax(logits, -1)  # 0.636 0.234 0.086 0.032 0.012

    def kept(top: torch.Tensor, k: int) -> torch.Tensor:
        return torch.cat([top[:k] / top[:k].sum(), torch.zeros(len(top) - k)])

    assert torch.allclose(Sampling(temperature=1.0, top_k=3).probabilities(logits), kept(full, 3))
    # top-p 0.8: 0.636 alone falls short, with 0.234 it reaches 0.87
    assert torch.allclose(Sampling(temperature=1.0, top_p=0.8).probabilities(logits), kept(full, 2))
    assert torch.allclose(Sampling(temperature=1.0, top_p=0.5).probabilities(logits), kept(full, 1))
    # however small top-p, the most likely token stays (float32's 1 - 1e-9 is 1.0)
    assert torch.equal(Sampling(temperature=1.0, top_p=1e-9).probabilities(logits), kept(full, 1))
    # top-k first, then top-p of what is left: 0.665 0.245 0.090, so 0.9 needs two
    both = Sampling(temperature=1.0, top_k=3, top_p=0.9).probabilities(logits)
    assert torch.allclose(both, kept(full, 2))
    # the temperature first: at T = 2 the top token holds 0.45 and top-p 0.8 keeps three
    hot = Sampling(temperature=2.0, top_p=0.8).probabilities(logits)
    assert torch.allclose(hot, kept(torch.softmax(logits / 2, -1), 3))
    assert torch.equal(Sampling(temperature=1.0, top_k=9).probabilities(logits), full)


def test_draw_follows_the_weights_and_never_draws_a_zero_weight_column(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weights = torch.tensor([[0.0, 3.0, 1.0, 0.0], [5.0, 0.0, 0.0, 5.0]])  # not normalised
    generator = torch.Generator().manual_seed(0)
    picks = draw(weights.repeat(ROWS // 2, 1), generator).view(-1, 2)
    first, second = frequencies(picks[:, 0], 4), frequencies(picks[:, 1], 4)
    assert (first - torch.tensor([0.0, 0.75, 0.25, 0.0], dtype=torch.float64)).abs().max() < 0.01
    assert (second - torch.tensor([0.5, 0.0, 0.0, 0.5], dtype=torch.float64)).abs().max() < 0.01
    # A uniform point at the very top of its range still lands on a column with weight.
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw["dtype"]))
    assert draw(torch.tensor([[1.0, 2.0, 0.0, 0.0]]), generator).tolist() == [1]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"temperature": 0.0}, "temperature must be a finite number > 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number > 0"),
        ({"temperature": 1.0, "drafts": "beam"}, "drafts must be one of sampled, greedy"),
        ({"temperature": 1.0, "top_k": -1}, "top_k must be 0 .off. or a number of tokens"),
        ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_sampling_settings_are_checked(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Sampling(**settings)  # type: ignore[arg-type]


# --- the verification loop -------------------------------------------------------------------


#: One drafter of every kind (a head corrects every proposal: Domino's prefix is off).
KINDS: dict[str, dict[str, object]] = {
    "dflash": {},
    "domino": {
        "block_size": 4, "projector_type": "domino", "emb_dim": 32, "gru_hidden_dim": 16,
        "pure_draft_prefix_len": 0,
    },
    "dspark": {"block_size": 5, "projector_type": "dspark", "markov_rank": 8},
    "dflash2": {
        "block_size": 4, "projector_type": "dflash2", "conv_kernel_size": 2,
        "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 3,
    },
}  # fmt: skip


def kind_setup(
    root: Path, kind: str, target_seed: int = 1
) -> tuple[PreTrainedModel, DFlashDraftModel, ResolvedDraft]:
    plan = tiny_plan(root, **KINDS[kind])
    target = tiny_target(plan)
    randomize(target, seed=target_seed)
    spec = plan.resolved_draft()
    drafter = DFlashDraftModel(spec)
    randomize(drafter, seed=2)
    return target.eval(), drafter.eval(), spec


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[PreTrainedModel, DFlashDraftModel, ResolvedDraft]:
    return kind_setup(tmp_path_factory.mktemp("sampling"), "dflash")


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_loop_commits_the_target_s_sampling_distribution(kind: str, tmp_path: Path) -> None:
    """Thousands of rows of one prompt, two new tokens each: the first comes from the
    prefill, the second from the first verification step (a proposal kept, or the token drawn
    after a rejection). Both follow the target's own distribution at the temperature, for
    every kind's way of drafting (a head's, the selector's among its candidates)."""
    target, drafter, spec = kind_setup(tmp_path, kind)
    temperature = 0.8
    prompt = list(PROMPTS[0])
    rows = 3_000
    results = speculative_generate_batch(
        target, drafter, spec, [prompt] * rows, max_new_tokens=2, eos_token_id=None,
        sampling=Sampling(temperature=temperature, seed=11),
    )  # fmt: skip
    assert all(len(r.tokens) == 2 and len(r.accepted_per_step) == 1 for r in results)
    first = torch.tensor([r.tokens[0] for r in results])
    second = torch.tensor([r.tokens[1] for r in results])
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt])).logits[0, -1]
    vocab = logits.shape[-1]
    p = torch.softmax(logits.double() / temperature, -1)
    assert (frequencies(first, vocab) - p).abs().max() < 0.04
    # The second token's expected frequencies: the target's distribution after each row's
    # first token, averaged over the rows.
    seen = sorted(set(first.tolist()))
    with torch.no_grad():
        inputs = torch.tensor([[*prompt, token] for token in seen])
        after = torch.softmax(target(input_ids=inputs).logits[:, -1].double() / temperature, -1)
    expected = after[torch.tensor([seen.index(t) for t in first.tolist()])].mean(dim=0)
    assert (frequencies(second, vocab) - expected).abs().max() < 0.03


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_records_one_distribution_per_proposal_that_covers_it(
    kind: str, tmp_path: Path
) -> None:
    target, drafter, spec = kind_setup(tmp_path, kind)
    block = as_block_drafter(drafter, target, spec)
    assert isinstance(block, DFlashBlockDrafter)
    rows = 64
    prompt = torch.tensor([list(PROMPTS[0])])
    with torch.no_grad():
        hidden_states = target(input_ids=prompt, output_hidden_states=True).hidden_states
        fused = block.fuse(taps_from_hidden_states(hidden_states, spec.target_layer_ids))
        hidden = block.draft_hidden_fused(
            fused[:, :-1].expand(rows, -1, -1), [prompt.shape[1] - 1] * rows, [7] * rows
        )
        sampling = Sampling(temperature=1.0, seed=0)
        recorder = DraftRecorder(sampling, sampling.generator(torch.device("cpu")))
        proposals = torch.tensor(block.propose_from_hidden(hidden, [7] * rows, recorder))
    q = recorder.distributions(target.config.vocab_size)
    assert q.shape == (rows, spec.drafted_tokens, target.config.vocab_size)
    assert torch.allclose(q.sum(-1), torch.ones(rows, spec.drafted_tokens))
    assert (q.gather(-1, proposals.unsqueeze(-1)) > 0).all()
    assert len({tuple(r) for r in proposals.tolist()}) > 1  # drawn, not the argmax every time
    if kind == "dflash2":  # the selector draws among its top-K candidates only
        assert ((q > 0).sum(-1) <= 3).all()


def test_a_seed_repeats_a_measurement_and_another_changes_it(
    setup: tuple[PreTrainedModel, DFlashDraftModel, ResolvedDraft],
) -> None:
    target, drafter, spec = setup
    prompts = [list(p) for p in PROMPTS[:3]]

    def run(seed: int) -> list[tuple[list[int], list[int]]]:
        results = speculative_generate_batch(
            target, drafter, spec, prompts, max_new_tokens=12, eos_token_id=None,
            sampling=Sampling(temperature=1.0, seed=seed),
        )  # fmt: skip
        return [(r.tokens, r.accepted_per_step) for r in results]

    once = run(5)
    assert once == run(5)
    assert once != run(6)
    for tokens, taus in once:
        assert len(tokens) == 12
        assert all(1 <= tau <= spec.drafted_tokens + 1 for tau in taus)


def test_sampling_refuses_a_drafter_that_gives_no_distributions(
    setup: tuple[PreTrainedModel, DFlashDraftModel, ResolvedDraft],
) -> None:
    target, _, spec = setup

    class Fixed:
        def propose(self, context: DraftContext) -> list[int]:
            return [1] * spec.drafted_tokens

    with pytest.raises(ValueError, match="Fixed proposes tokens only; sampled verification"):
        speculative_generate_batch(
            target, Fixed(), spec, [list(PROMPTS[0])], max_new_tokens=4, eos_token_id=None,
            sampling=Sampling(temperature=1.0),
        )  # fmt: skip


def test_a_sampled_report_is_not_called_lossless_and_the_card_says_how_it_decoded(
    setup: tuple[PreTrainedModel, DFlashDraftModel, ResolvedDraft],
) -> None:
    target, drafter, spec = setup
    prompts = [list(p) for p in PROMPTS[:2]]
    report = evaluate_acceptance(
        target, drafter, spec, prompts, max_new_tokens=8, eos_token_id=None,
        sampling=Sampling(temperature=0.9, seed=1, drafts="greedy"),
    )  # fmt: skip
    assert report.lossless is None and report.mismatched_prompts == []
    greedy = evaluate_acceptance(
        target, drafter, spec, prompts, max_new_tokens=8, eos_token_id=None
    )
    assert greedy.lossless is True
    row = report.to_dict()
    row["settings"] = {
        "decoding": "sampling", "temperature": 0.9, "draft_sampling": "greedy", "seed": 1,
    }  # fmt: skip
    measured = measurement_from_report(row, source="eval")
    assert measured is not None
    assert measured.decoding == "sampling at temperature 0.9 (drafts greedy, seed 1)"
    cut = measurement_from_report(
        {**row, "settings": {**row["settings"], "top_k": 20, "top_p": 0.95}}, source="eval"
    )
    assert cut is not None
    assert cut.decoding == (
        "sampling at temperature 0.9 (top-k 20, top-p 0.95, drafts greedy, seed 1)"
    )
    card = "\n".join(_measured(measured))
    assert "| decoding | sampling at temperature 0.9 (drafts greedy, seed 1) |" in card
    assert card.startswith("Speculative sampling against the target")
    assert "| output equals greedy decoding | - |" in card
    greedy_card = "\n".join(_measured(measurement_from_report(greedy.to_dict(), source="eval")))
    assert (
        greedy_card.startswith("Greedy speculative decoding")
        and "| decoding | greedy |" in greedy_card
    )


# --- the command ------------------------------------------------------------------------------


def test_the_eval_command_samples_at_a_temperature_and_records_it(
    eval_setup: tuple[Path, Path], tmp_path: Path
) -> None:
    plan_file, export = eval_setup
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["the quick brown fox", "a lazy dog"]))
    args = ["eval", str(plan_file), "--checkpoint", str(export), "--prompts", str(prompts)]
    args += ["--max-new-tokens", "6"]
    sampled = cli(*args, "--temperature", "0.7", "--seed", "3", "--json")
    assert sampled.exit_code == 0, sampled.output
    row = json.loads(sampled.stdout)
    assert row["lossless"] is None
    settings = row["settings"]
    assert settings["decoding"] == "sampling" and settings["temperature"] == 0.7
    assert settings["draft_sampling"] == "sampled" and settings["seed"] == 3
    again = json.loads(cli(*args, "--temperature", "0.7", "--seed", "3", "--json").stdout)
    assert again["tau_per_prompt"] == row["tau_per_prompt"]

    console = cli(*args, "--temperature", "0.7", "--draft-sampling", "greedy")
    assert console.exit_code == 0, console.output
    assert (
        "sampling at temperature 0.7 (drafts greedy, seed 0): lossless in distribution, "
        "no greedy check" in console.output
    )
    cut = cli(*args, "--temperature", "1", "--top-k", "20", "--top-p", "0.95", "--json")
    cut_settings = json.loads(cut.stdout)["settings"]
    assert cut_settings["top_k"] == 20 and cut_settings["top_p"] == 0.95
    assert settings["top_k"] == 0 and settings["top_p"] == 1.0
    greedy = json.loads(cli(*args, "--json").stdout)
    assert greedy["settings"]["decoding"] == "greedy" and greedy["settings"]["seed"] is None
    assert greedy["settings"]["top_k"] is None and greedy["settings"]["top_p"] is None

    defaults = (["--seed", "0"], ["--draft-sampling", "sampled"], ["--top-k", "0"])
    defaults += (["--top-p", "1"],)
    for flag in defaults:  # even at their defaults
        refused = cli(*args, *flag)
        assert refused.exit_code == 2
        assert f"{flag[0]} apply to sampled verification only" in refused.output
        assert "Traceback" not in refused.output
    for value in ("nan", "inf"):
        refused = cli(*args, "--temperature", value)
        assert refused.exit_code == 2
        assert f"--temperature must be a finite number >= 0, got {value}" in refused.output


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A saved tiny target and tokenizer, an exported random drafter, the plan file."""
    root = tmp_path_factory.mktemp("eval-sampling")
    plan, export = saved_eval_setup(root, ["the quick brown fox", "a lazy dog"])
    plan_file = root / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    return plan_file, export
