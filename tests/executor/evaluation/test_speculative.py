"""Speculative decoding and measured acceptance: lossless output, tau, per-position accounting."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
import torch
from testkit.tiny import MAX_NEW, PROMPTS, randomize, saved_eval_setup, tiny_plan, tiny_target
from transformers import AutoTokenizer, PreTrainedModel

from dflash_recipes.data.conversations import Conversation, Message, read_conversations
from dflash_recipes.errors import CheckpointError, DataError
from dflash_recipes.executor.demo.tiny_tokenizer import build_tiny_tokenizer
from dflash_recipes.executor.evaluation.cached_decoding import speculative_generate
from dflash_recipes.executor.evaluation.evaluate import (
    acceptance_from_steps,
    evaluate_acceptance,
    evaluate_on_plan_data,
    prompts_from_conversations,
    run_eval,
)
from dflash_recipes.executor.evaluation.speculative import (
    DFlashBlockDrafter,
    DraftContext,
    greedy_generate,
    is_greedy_decoding,
)
from dflash_recipes.executor.kinds.domino import domino_head
from dflash_recipes.executor.kinds.dspark import dspark_head
from dflash_recipes.executor.model.convert import (
    convert,
    dflash_module,
    embed_tokens,
    lm_head,
    load_base_model,
)
from dflash_recipes.executor.model.draft import DFlashDraftModel, taps_from_hidden_states
from dflash_recipes.executor.model.masks import build_dense_block_mask
from dflash_recipes.executor.model.weights import load_drafter_weights
from dflash_recipes.executor.training.anchors import block_positions
from dflash_recipes.executor.training.checkpoints import save_training_checkpoint
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import RunPlan

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base_plan(tmp_path_factory: pytest.TempPathFactory) -> RunPlan:
    return tiny_plan(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def target(base_plan: RunPlan) -> PreTrainedModel:
    model = tiny_target(base_plan)
    randomize(model, seed=1)
    return model


def make_spec(plan_dir: Path, **overrides: object) -> tuple[RunPlan, ResolvedDraft]:
    plan = tiny_plan(plan_dir, **overrides)
    return plan, plan.resolved_draft()


def make_drafter(spec: ResolvedDraft, seed: int = 2) -> DFlashDraftModel:
    drafter = DFlashDraftModel(spec)
    randomize(drafter, seed)
    return drafter.eval()


class PrefixOracle:
    """Proposes the target's greedy tokens for the first `correct` positions, then wrong ones.

    Knows the greedy continuation of each prompt in advance, and checks what the loop hands a
    drafter: the committed tokens are a prefix of greedy output, the taps cover exactly the
    positions before the anchor.
    """

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], correct: int) -> None:
        self.continuations = continuations
        self.correct = correct
        self.calls = 0

    def propose(self, context: DraftContext) -> list[int]:
        self.calls += 1
        committed = list(context.committed)
        matches = [
            [*p, *c] for p, c in self.continuations.items() if committed[: len(p)] == list(p)
        ]
        assert len(matches) == 1
        full = matches[0]
        assert committed == full[: len(committed)], "the loop committed a non-greedy token"
        assert context.taps.shape[:2] == (1, len(committed) - 1)
        right = full[len(committed) : len(committed) + context.block_size - 1]
        assert len(right) == context.block_size - 1
        return [t if k < self.correct else (t + 1) % 100 for k, t in enumerate(right)]


def continuations(
    target: PreTrainedModel, prompts: Sequence[Sequence[int]], length: int
) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): greedy_generate(target, p, length, None) for p in prompts}


# ---------------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------------


def test_greedy_generate_equals_hf_generate(target: PreTrainedModel) -> None:
    prompt = list(PROMPTS[0])
    ours = greedy_generate(target, prompt, MAX_NEW, None)
    out = target.generate(  # type: ignore[operator]
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=MAX_NEW,
        min_new_tokens=MAX_NEW,
        do_sample=False,
        pad_token_id=0,
    )
    assert ours == out[0, len(prompt) :].tolist()


def test_greedy_generate_stops_after_eos(target: PreTrainedModel) -> None:
    full = greedy_generate(target, PROMPTS[0], MAX_NEW, None)
    eos = full[4]
    stopped = greedy_generate(target, PROMPTS[0], MAX_NEW, eos)
    assert stopped == full[: full.index(eos) + 1]


def test_one_pass_greedy_check_accepts_exactly_greedy_decoding(target: PreTrainedModel) -> None:
    for prompt in PROMPTS:
        full = greedy_generate(target, prompt, MAX_NEW, None)
        assert is_greedy_decoding(target, prompt, full, MAX_NEW, None)
        # Any changed token, at the start, middle or end, is caught.
        for index in (0, MAX_NEW // 2, MAX_NEW - 1):
            wrong = list(full)
            wrong[index] = (wrong[index] + 1) % 100
            assert not is_greedy_decoding(target, prompt, wrong, MAX_NEW, None), index
        # Stopping early without an eos, or running past the limit, is not greedy decoding.
        assert not is_greedy_decoding(target, prompt, full[:-1], MAX_NEW, None)
        longer = greedy_generate(target, prompt, MAX_NEW + 1, None)
        assert not is_greedy_decoding(target, prompt, longer, MAX_NEW, None)
    # With an eos: greedy decoding stops right after the first one.
    full = greedy_generate(target, PROMPTS[0], MAX_NEW, None)
    eos = full[4]
    stopped = greedy_generate(target, PROMPTS[0], MAX_NEW, eos)
    assert is_greedy_decoding(target, PROMPTS[0], stopped, MAX_NEW, eos)
    assert not is_greedy_decoding(target, PROMPTS[0], full, MAX_NEW, eos)  # ran past the eos
    assert is_greedy_decoding(target, PROMPTS[0], [], 0, None)


class _WrongCommit:
    """Speculative decoding with a bug: every output's last token is replaced."""

    def __init__(self, real: object) -> None:
        self.real = real

    def __call__(self, *args: object, **kwargs: object) -> object:
        results = self.real(*args, **kwargs)  # type: ignore[operator]
        wrong = []
        for result in results:
            tokens = list(result.tokens)
            tokens[-1] = (tokens[-1] + 1) % 100
            wrong.append(attrs.evolve(result, tokens=tokens))
        return wrong


def test_acceptance_report_flags_output_that_is_not_greedy(
    target: PreTrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash_recipes.executor.evaluation.evaluate as evaluate

    _, spec = make_spec(tmp_path, block_size=4)
    monkeypatch.setattr(
        evaluate, "speculative_generate_batch", _WrongCommit(evaluate.speculative_generate_batch)
    )
    prompts = [list(p) for p in PROMPTS]
    report = evaluate_acceptance(
        target,
        make_drafter(spec),
        spec,
        prompts,
        max_new_tokens=MAX_NEW,
        eos_token_id=None,
    )
    assert not report.lossless
    assert report.mismatched_prompts == [0, 1, 2]


# ---------------------------------------------------------------------------------------------
# acceptance accounting with drafters whose quality is known
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("block_size", "correct"), [(4, 0), (4, 1), (4, 3), (2, 1), (6, 5)])
def test_tau_is_exactly_the_oracles_correct_prefix_plus_one(
    target: PreTrainedModel, tmp_path: Path, block_size: int, correct: int
) -> None:
    _, spec = make_spec(tmp_path, block_size=block_size)
    prompts = [list(p) for p in PROMPTS]
    oracle = PrefixOracle(continuations(target, prompts, MAX_NEW + block_size), correct)
    report = evaluate_acceptance(
        target, oracle, spec, prompts, max_new_tokens=MAX_NEW, eos_token_id=None
    )
    tau = correct + 1
    assert report.lossless
    assert report.tau == tau
    assert report.tokens == MAX_NEW * len(prompts)
    # The prefill commits one token, each step commits tau: exactly this many steps per prompt.
    assert report.steps == len(prompts) * math.ceil((MAX_NEW - 1) / tau)
    assert oracle.calls == report.steps
    expected_rates = [1.0] * correct + [0.0] * (block_size - 1 - correct)
    assert report.per_position_acceptance == expected_rates
    reached = [report.steps if k <= correct + 1 else 0 for k in range(1, block_size)]
    assert report.reached_per_position == reached


def test_perfect_drafter_fills_every_block(target: PreTrainedModel, tmp_path: Path) -> None:
    _, spec = make_spec(tmp_path, block_size=5)
    prompt = list(PROMPTS[1])
    oracle = PrefixOracle(continuations(target, [prompt], 40), correct=4)
    result = speculative_generate(
        target, oracle, spec, prompt, max_new_tokens=33, eos_token_id=None
    )
    assert result.accepted_per_step == [5] * 7
    assert result.tokens == greedy_generate(target, prompt, 33, None)


def test_always_wrong_drafter_accepts_only_the_bonus(
    target: PreTrainedModel, tmp_path: Path
) -> None:
    _, spec = make_spec(tmp_path, block_size=4)
    prompt = list(PROMPTS[0])
    oracle = PrefixOracle(continuations(target, [prompt], 20), correct=0)
    result = speculative_generate(target, oracle, spec, prompt, max_new_tokens=9, eos_token_id=None)
    assert result.accepted_per_step == [1] * 8
    assert result.tokens == greedy_generate(target, prompt, 9, None)


def test_generation_stops_after_eos(target: PreTrainedModel, tmp_path: Path) -> None:
    _, spec = make_spec(tmp_path, block_size=4)
    prompt = list(PROMPTS[0])
    full = greedy_generate(target, prompt, MAX_NEW, None)
    eos = full[6]
    oracle = PrefixOracle({tuple(prompt): full + [0] * 8}, correct=3)
    result = speculative_generate(
        target, oracle, spec, prompt, max_new_tokens=MAX_NEW, eos_token_id=eos
    )
    assert result.tokens == full[: full.index(eos) + 1]
    assert result.tokens == greedy_generate(target, prompt, MAX_NEW, eos)


def test_acceptance_from_steps_counts_reached_and_accepted() -> None:
    rates, reached = acceptance_from_steps([1, 3, 4], block_size=4)
    assert reached == [3, 2, 2]
    assert rates == [2 / 3, 1.0, 0.5]


# ---------------------------------------------------------------------------------------------
# real drafters
# ---------------------------------------------------------------------------------------------

VARIANTS: list[dict[str, object]] = [
    {"block_size": 2},
    {"block_size": 4},
    {"block_size": 7},
    {"block_size": 4, "projector_type": "domino", "emb_dim": 32, "gru_hidden_dim": 16},
    {"block_size": 5, "projector_type": "dspark", "markov_rank": 8, "use_confidence_head": True},
]


@pytest.mark.parametrize(
    "overrides", VARIANTS, ids=lambda o: f"{o.get('projector_type', 'dflash')}-b{o['block_size']}"
)
def test_random_drafter_is_lossless(
    target: PreTrainedModel, tmp_path: Path, overrides: dict[str, object]
) -> None:
    _, spec = make_spec(tmp_path, **overrides)
    drafter = make_drafter(spec)
    report = evaluate_acceptance(
        target, drafter, spec, [list(p) for p in PROMPTS], max_new_tokens=MAX_NEW, eos_token_id=None
    )
    assert report.lossless, report.mismatched_prompts
    assert report.tokens == MAX_NEW * len(PROMPTS)
    assert 1.0 <= report.tau <= spec.drafted_tokens + 1
    # a head with shift_label drafts block_size tokens (SGLang's k_draft), plain DFlash one less
    assert spec.drafted_tokens == spec.block_size - (spec.projector_type == "dflash")
    assert len(report.per_position_acceptance) == spec.drafted_tokens
    assert all(0.0 <= r <= 1.0 for r in report.per_position_acceptance)
    assert report.reached_per_position[0] == report.steps
    json.dumps(report.to_dict(), allow_nan=False)


def test_drafter_sees_what_training_shows_it(target: PreTrainedModel, tmp_path: Path) -> None:
    """One block at inference equals the same block in a packed training forward."""
    _, spec = make_spec(tmp_path, block_size=4)
    drafter = make_drafter(spec)
    block = DFlashBlockDrafter(drafter, embed_tokens(target), lm_head(target), spec)
    ids = list(PROMPTS[0]) + greedy_generate(target, PROMPTS[0], 14, None)
    with torch.no_grad():
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        taps = taps_from_hidden_states(out.hidden_states, spec.target_layer_ids)
        anchors = torch.tensor([[2, 7, 15]])
        valid = torch.ones_like(anchors, dtype=torch.bool)
        block_ids = torch.full((1, 3, 4), spec.mask_token_id)
        block_ids[0, :, 0] = torch.tensor([ids[a] for a in anchors[0].tolist()])
        packed = drafter(
            embed_tokens(target)(block_ids.view(1, -1)),
            drafter.fuse_context(taps),
            block_positions(anchors, 4),
            torch.arange(len(ids)).unsqueeze(0),
            build_dense_block_mask(anchors, 4, len(ids), valid),
        )
        for i, a in enumerate(anchors[0].tolist()):
            context = DraftContext(committed=tuple(ids[: a + 1]), taps=taps[:, :a], block_size=4)
            alone = block.draft_hidden(context)
            torch.testing.assert_close(alone, packed[:, 4 * i : 4 * i + 4], atol=1e-5, rtol=1e-5)


def test_context_taps_come_from_the_committed_tokens(
    target: PreTrainedModel, tmp_path: Path
) -> None:
    """The taps reused from the verification pass equal a fresh pass over the context."""
    _, spec = make_spec(tmp_path, block_size=3)
    prompt = list(PROMPTS[0])
    inner = PrefixOracle(continuations(target, [prompt], 20), correct=1)
    seen: list[int] = []

    class Checking:
        def propose(self, context: DraftContext) -> list[int]:
            before = list(context.committed[:-1])
            out = target(input_ids=torch.tensor([before]), output_hidden_states=True)
            fresh = taps_from_hidden_states(out.hidden_states, spec.target_layer_ids)
            torch.testing.assert_close(context.taps, fresh, atol=1e-5, rtol=1e-5)
            seen.append(len(before))
            return inner.propose(context)

    speculative_generate(target, Checking(), spec, prompt, max_new_tokens=8, eos_token_id=None)
    assert seen == [len(prompt) + 2 * i for i in range(4)]


HEADS: list[dict[str, object]] = [
    {"projector_type": "domino", "emb_dim": 32, "gru_hidden_dim": 16},
    {"projector_type": "dspark", "markov_rank": 8},
]


@pytest.mark.parametrize("overrides", HEADS, ids=lambda o: str(o["projector_type"]))
def test_head_proposals_use_their_own_greedy_prefix(
    target: PreTrainedModel, tmp_path: Path, overrides: dict[str, object]
) -> None:
    """Each proposal is the head's argmax given the anchor and the proposals before it."""
    _, spec = make_spec(tmp_path, block_size=6, **overrides)
    drafter = make_drafter(spec, seed=3)
    with torch.no_grad():
        # Let the prefix decide: the head's correction outweighs the backbone logits and, for
        # domino, depends on the GRU state of the prefix only.
        if spec.projector_type == "domino":
            first, _, last = domino_head(drafter.head).embed_proj
            assert isinstance(first, torch.nn.Linear) and isinstance(last, torch.nn.Linear)
            first.weight[:, : spec.hidden_size] = 0.0
            last.weight.mul_(20.0)
        else:
            dspark_head(drafter.head).markov_w2.weight.mul_(20.0)
    embed = embed_tokens(target)
    block = DFlashBlockDrafter(drafter, embed, lm_head(target), spec)
    ids = list(PROMPTS[0]) + greedy_generate(target, PROMPTS[0], 6, None)
    with torch.no_grad():
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        taps = taps_from_hidden_states(out.hidden_states, spec.target_layer_ids)
        context = DraftContext(committed=tuple(ids), taps=taps[:, :-1], block_size=6)
        proposals = block.propose(context)
        hidden = block.draft_hidden(context)
        base = lm_head(target)(hidden)
        # With shift_label, index k of prev holds the token at anchor + k (heads.py): the anchor,
        # then the proposals; teacher-forced with them, one pass gives every position's logits.
        prev = torch.tensor([[ids[-1], *proposals[:-1]]])
        if spec.projector_type == "domino":
            logits = domino_head(drafter.head)(hidden, embed(prev), base)
        else:
            logits, _ = dspark_head(drafter.head)(hidden, prev, base)
    assert len(proposals) == 6
    assert proposals == logits[0].argmax(-1).tolist()
    # The head matters: without it the backbone alone proposes something else here.
    assert proposals != base[0].argmax(-1).tolist()


def test_converted_model_is_target_and_drafter_and_keeps_its_modes(tmp_path: Path) -> None:
    """The trainer's call: the converted model serves as both; the drafter stays in train mode."""
    plan, spec = make_spec(tmp_path, block_size=3)
    model = convert(tiny_target(plan), plan)
    dflash_module(model).train()
    report = evaluate_acceptance(
        model, model, spec, [list(PROMPTS[2])], max_new_tokens=4, eos_token_id=None
    )
    assert report.lossless
    assert dflash_module(model).training
    assert not model.model.training


# ---------------------------------------------------------------------------------------------
# prompts and the CLI's library call
# ---------------------------------------------------------------------------------------------

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a drafter proposes a block and the target verifies it",
    "speculative decoding is lossless when verification is greedy",
]


def write_jsonl(path: Path, lines: Sequence[object]) -> Path:
    path.write_text("".join(x if isinstance(x, str) else json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunPlan, Path]:
    """A saved tiny target with a tiny tokenizer, and an exported random drafter."""
    return saved_eval_setup(tmp_path_factory.mktemp("eval"), TEXTS)


def test_prompt_is_the_conversation_before_the_first_assistant_turn() -> None:
    tokenizer = build_tiny_tokenizer(TEXTS, vocab_size=300)
    conversation = Conversation(
        1,
        (
            Message("system", "be brief"),
            Message("user", "the quick brown fox"),
            Message("assistant", "jumps over"),
            Message("user", "the lazy dog"),
        ),
    )
    opens_with_answer = Conversation(2, (Message("assistant", "hello"),))
    prompts = prompts_from_conversations([opens_with_answer, conversation], tokenizer)
    assert len(prompts) == 1
    text = tokenizer.decode(prompts[0])
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nthe quick brown fox"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_run_eval_measures_the_exported_drafter(
    eval_setup: tuple[RunPlan, Path], tmp_path: Path
) -> None:
    plan, export = eval_setup
    prompts_file = write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"messages": [{"role": "user", "content": "the quick brown fox"}]},
            "not json\n",
            {
                "conversations": [
                    {"from": "human", "value": "a drafter"},
                    {"from": "gpt", "value": "x"},
                ]
            },
            {"messages": [{"role": "user", "content": "the lazy dog"}]},
        ],
    )
    report = run_eval(plan, export, prompts_file, max_new_tokens=6, num_prompts=2)
    assert report.num_prompts == 2
    assert report.lossless
    assert 1 <= report.tokens <= 12

    # Same figures as evaluating the exported weights in memory on the first two usable lines.
    tokenizer = AutoTokenizer.from_pretrained(plan.base_model.path)
    target = load_base_model(plan)
    drafter = DFlashDraftModel(plan.resolved_draft())
    assert load_drafter_weights(drafter, export) == len(drafter.state_dict())
    prompts = prompts_from_conversations(
        read_conversations(prompts_file, answer_only_loss=False).conversations, tokenizer, limit=2
    )
    again = evaluate_acceptance(
        target,
        drafter,
        plan.resolved_draft(),
        prompts,
        max_new_tokens=6,
        eos_token_id=tokenizer.eos_token_id,
    )
    assert again.settings is None  # in memory: no file, no template recorded
    assert attrs.evolve(again, settings=report.settings) == report


def test_run_eval_reads_eval_data_path_and_training_checkpoints(
    eval_setup: tuple[RunPlan, Path], tmp_path: Path
) -> None:
    plan, export = eval_setup
    held_out = write_jsonl(
        tmp_path / "held_out.jsonl",
        [
            {"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t}]}
            for t in TEXTS
        ],
    )
    plan = attrs.evolve(plan, data=attrs.evolve(plan.data, eval_data_path=str(held_out)))
    report = run_eval(plan, export, None, max_new_tokens=4, num_prompts=8)
    assert report.num_prompts == len(TEXTS)
    assert report.lossless

    # A training checkpoint of the same weights measures the same, and so does the trainer's
    # in-memory call on a converted model.
    model = convert(load_base_model(plan), plan)
    load_drafter_weights(dflash_module(model), export)
    optimizer = torch.optim.SGD(dflash_module(model).parameters(), lr=0.1)
    checkpoint = save_training_checkpoint(tmp_path / "run", 3, model, optimizer, None, {})
    assert run_eval(plan, checkpoint, None, max_new_tokens=4, num_prompts=8) == report
    tokenizer = AutoTokenizer.from_pretrained(plan.base_model.path)
    in_training = evaluate_on_plan_data(plan, model, model, tokenizer, max_new_tokens=4)
    assert in_training == report  # its default of 4 prompts covers all 3 here


def test_run_eval_errors_say_what_to_pass(eval_setup: tuple[RunPlan, Path], tmp_path: Path) -> None:
    plan, export = eval_setup
    with pytest.raises(DataError, match=r"--prompts FILE or set data\.eval_data_path"):
        run_eval(plan, export, None)
    prompts_file = write_jsonl(
        tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "the"}]}]
    )
    run_dir = tmp_path / "out"
    (run_dir / "export").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"output_dir: pass .*export"):
        run_eval(plan, run_dir, prompts_file)
    other = tiny_plan(
        tmp_path,
        target_vocab_size=plan.resolved_draft().vocab_size,
        mask_token_id=plan.draft.mask_token_id,
        num_hidden_layers=1,
    )
    with pytest.raises(CheckpointError, match="does not hold the drafter the plan describes"):
        run_eval(attrs.evolve(plan, draft=other.draft), export, prompts_file)

    # The base model without its tokenizer files: the loader's error, as in training.
    bare = tmp_path / "bare_base"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(Path(plan.base_model.path) / name, bare / name)
    no_tokenizer = attrs.evolve(plan, base_model=attrs.evolve(plan.base_model, path=str(bare)))
    with pytest.raises(CheckpointError, match=r"has no tokenizer files .*hf download"):
        run_eval(no_tokenizer, export, prompts_file)
