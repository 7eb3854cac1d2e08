"""The training dataset: reading conversations, tokenizing with loss masks, resumable batches."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from testkit.tiny import tiny_plan
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dflash_recipes.data.conversations import Message, read_conversations
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.tokenize import (
    DatasetStats,
    TokenizedExample,
    tokenize_conversation,
)
from dflash_recipes.executor.data.train_dataset import (
    TrainDataset,
    batches,
    batches_per_epoch,
    build_dataset,
    epoch_order,
)
from dflash_recipes.executor.demo.tiny_tokenizer import (
    TINY_CHAT_TEMPLATE,
    build_tiny_tokenizer,
    spare_token_ids,
)
from dflash_recipes.executor.kinds.dflash import dflash_loss
from dflash_recipes.executor.training.anchors import block_inputs, block_labels, sample_anchors
from dflash_recipes.plan.run_plan import RunPlan

CORPUS = [
    "You are a helpful assistant.",
    "What is the capital of France? The capital of France is Paris.",
    "Tell me a joke about cats. Why did the cat sit on the computer? To keep an eye on the mouse.",
    "hello hello world, the quick brown fox jumps over the lazy dog",
]

#: ChatML without generation markers; prefix-stable (a turn renders the same whatever follows).
PLAIN_CHATML = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

#: Like Qwen3: the final assistant turn gets an empty think block, earlier turns do not, so a
#: turn renders differently once later turns follow it.
THINKING_CHATML = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and loop.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TWO_TURNS = (
    Message("system", "You are a helpful assistant."),
    Message("user", "What is the capital of France?"),
    Message("assistant", "The capital of France is Paris."),
    Message("user", "Tell me a joke about cats."),
    Message("assistant", "Why did the cat sit on the computer?"),
)


@cache
def _tokenizer() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer(CORPUS)


def _supervised_text(tok: PreTrainedTokenizerFast, example: TokenizedExample) -> list[str]:
    """Decoded runs of consecutive supervised tokens."""
    runs: list[list[int]] = []
    previous = 0
    for token, m in zip(example.input_ids, example.loss_mask, strict=True):
        if m and not previous:
            runs.append([])
        if m:
            runs[-1].append(token)
        previous = m
    return [str(tok.decode(run)) for run in runs]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _openai(*turns: tuple[str, str]) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})


def _plan(
    tmp_path: Path,
    data_path: Path | None,
    *,
    chat_template: Path | None = None,
    answer_only_loss: bool = True,
    seq_len: int = 256,
    block_size: int = 4,
) -> RunPlan:
    return tiny_plan(
        tmp_path,
        data_path=None if data_path is None else str(data_path),
        chat_template=None if chat_template is None else str(chat_template),
        answer_only_loss=answer_only_loss,
        training_seq_len=seq_len,
        block_size=block_size,
    )


# -- reading -----------------------------------------------------------------------------------


def test_reads_openai_and_sharegpt_and_reports_every_bad_line(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "data.jsonl",
        [
            _openai(("user", "hi"), ("assistant", "hello")),  # 1 ok
            json.dumps(
                {
                    "conversations": [
                        {"from": "system", "value": "be brief"},
                        {"from": "human", "value": "hi"},
                        {"from": "gpt", "value": "hey"},
                    ]
                }
            ),  # 2 ok (ShareGPT)
            '{"messages": [',  # 3 invalid JSON
            "",  # 4 blank: ignored
            "[1, 2]",  # 5 not an object
            json.dumps({"text": "hi"}),  # 6 neither key
            json.dumps({"messages": []}),  # 7 empty
            _openai(("user", "hi"), ("robot", "beep")),  # 8 bad role
            json.dumps({"messages": [{"role": "user", "content": ["a", "b"]}]}),  # 9 content
            _openai(("system", "x"), ("user", "only a question")),  # 10 no assistant
            "{not json",  # 11 invalid JSON
        ],
    )
    file = read_conversations(path)
    assert [c.line for c in file.conversations] == [1, 2]
    assert file.conversations[1].messages == (
        Message("system", "be brief"),
        Message("user", "hi"),
        Message("assistant", "hey"),
    )
    by_line = {s.line: s for s in file.skipped}
    assert sorted(by_line) == [3, 5, 6, 7, 8, 9, 10, 11]
    assert by_line[3].kind == "invalid JSON"
    assert "column" in by_line[3].reason
    assert by_line[5].reason == "expected a JSON object, got a list"
    assert "neither a 'messages'" in by_line[6].reason and "keys: text" in by_line[6].reason
    assert by_line[7].kind == "empty conversation"
    assert by_line[8].reason.startswith("messages[1] has role 'robot'; expected one of")
    assert by_line[9].reason == "messages[0] 'content' must be a string, got a list"
    assert by_line[10].kind == "no assistant turn"
    assert file.summary == (
        "used 2 conversations, skipped 8: 2 invalid JSON (lines 3, 11), "
        "1 not an object (line 5), 1 no conversation key (line 6), "
        "1 empty conversation (line 7), 1 bad role (line 8), 1 non-string content (line 9), "
        "1 no assistant turn (line 10)"
    )


def test_conversations_without_answers_are_kept_when_every_token_is_supervised(
    tmp_path: Path,
) -> None:
    path = _write(tmp_path / "d.jsonl", [_openai(("user", "just text"))])
    assert len(read_conversations(path, answer_only_loss=False).conversations) == 1
    with pytest.raises(DataError, match="no assistant turn"):
        read_conversations(path, answer_only_loss=True)


def test_sharegpt_unknown_speaker_is_named(tmp_path: Path) -> None:
    line = json.dumps({"conversations": [{"from": "bot", "value": "x"}]})
    file = read_conversations(_write(tmp_path / "d.jsonl", [line, _openai(("assistant", "ok"))]))
    assert file.skipped[0].reason == (
        "conversations[0] has from 'bot'; expected one of system, human, user, gpt, assistant, "
        "tool, observation, function_response, function_call"
    )


def test_unusable_file_raises_with_the_per_line_reasons(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "bad.jsonl", ["oops", json.dumps({"messages": []}), "[]", "1", "2", "3", "4"]
    )
    with pytest.raises(DataError) as info:
        read_conversations(path)
    message = str(info.value)
    assert message.startswith(f"no usable conversation in {path} (used 0 conversations, skipped 7")
    assert "line 1: invalid JSON" in message
    assert "line 2: 'messages' is an empty list" in message
    assert "... and 2 more" in message  # only the first five reasons are quoted


def test_missing_or_empty_file_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist; set data.data_path"):
        read_conversations(tmp_path / "nope.jsonl")
    empty = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match="is empty"):
        read_conversations(empty)


def test_invalid_utf8_is_reported_per_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(_openai(("assistant", "fine")).encode() + b"\n\xff\xfe\n")
    file = read_conversations(path)
    assert [(s.line, s.kind) for s in file.skipped] == [(2, "not UTF-8")]


# -- tokenizing --------------------------------------------------------------------------------


def test_generation_markers_supervise_exactly_the_answers_and_their_end_token() -> None:
    tok = _tokenizer()
    example = tokenize_conversation(
        tok, TWO_TURNS, chat_template=None, answer_only_loss=True, max_len=1000
    )
    assert len(example.input_ids) == len(example.loss_mask)
    assert _supervised_text(tok, example) == [
        "The capital of France is Paris.<|im_end|>",
        "Why did the cat sit on the computer?<|im_end|>",
    ]
    assert not example.truncated


def test_template_without_markers_gives_the_same_mask_as_with_markers() -> None:
    tok = _tokenizer()
    marked = tokenize_conversation(
        tok, TWO_TURNS, chat_template=TINY_CHAT_TEMPLATE, answer_only_loss=True, max_len=1000
    )
    plain = tokenize_conversation(
        tok, TWO_TURNS, chat_template=PLAIN_CHATML, answer_only_loss=True, max_len=1000
    )
    assert plain.input_ids == marked.input_ids
    assert plain.loss_mask == marked.loss_mask


def test_template_that_rerenders_turns_still_masks_each_answer() -> None:
    tok = _tokenizer()
    messages = (
        Message("user", "Say: the cat"),  # the user quotes the first answer before it appears
        Message("assistant", "the cat"),
        Message("user", "again"),
        Message("assistant", "the cat"),
    )
    example = tokenize_conversation(
        tok, messages, chat_template=THINKING_CHATML, answer_only_loss=True, max_len=1000
    )
    # The earlier answer is found after its own header (not in the user's quote) and closed by
    # its end-of-turn token; the final one includes the think block the model generates.
    assert _supervised_text(tok, example) == [
        "the cat<|im_end|>",
        "<think>\n\n</think>\n\nthe cat<|im_end|>",
    ]


def test_prefix_rendering_masks_answers_even_when_the_template_rewrites_them() -> None:
    tok = _tokenizer()
    upper = PLAIN_CHATML.replace("m['content']", "(m['content'] | upper)")
    example = tokenize_conversation(
        tok, TWO_TURNS[:3], chat_template=upper, answer_only_loss=True, max_len=1000
    )
    assert _supervised_text(tok, example) == ["THE CAPITAL OF FRANCE IS PARIS.<|im_end|>"]


def test_answer_that_can_be_located_neither_way_is_a_clear_error() -> None:
    # Re-renders earlier turns (not prefix-stable) and rewrites the text (not findable).
    upper = THINKING_CHATML.replace("m['content']", "(m['content'] | upper)")
    with pytest.raises(DataError, match=r"could not locate assistant turn 3.*\{% generation %\}"):
        tokenize_conversation(
            _tokenizer(), TWO_TURNS, chat_template=upper, answer_only_loss=True, max_len=1000
        )


def test_without_answer_only_loss_every_token_is_supervised() -> None:
    example = tokenize_conversation(
        _tokenizer(), TWO_TURNS, chat_template=None, answer_only_loss=False, max_len=1000
    )
    assert example.loss_mask == [1] * len(example.input_ids)


def test_long_conversations_are_truncated_to_max_len() -> None:
    tok = _tokenizer()
    full = tokenize_conversation(
        tok, TWO_TURNS, chat_template=None, answer_only_loss=True, max_len=1000
    )
    cut = tokenize_conversation(
        tok, TWO_TURNS, chat_template=None, answer_only_loss=True, max_len=7
    )
    assert cut.truncated
    assert cut.input_ids == full.input_ids[:7]
    assert cut.loss_mask == full.loss_mask[:7]


def test_broken_template_is_a_data_error() -> None:
    with pytest.raises(DataError, match="chat template could not render"):
        tokenize_conversation(
            _tokenizer(),
            TWO_TURNS,
            chat_template="{{ raise_exception('no system role') }}",
            answer_only_loss=True,
            max_len=100,
        )


# -- the tiny tokenizer ------------------------------------------------------------------------


def test_tiny_tokenizer_is_deterministic_and_reloadable(tmp_path: Path) -> None:
    a = build_tiny_tokenizer(CORPUS)
    b = build_tiny_tokenizer(list(reversed(CORPUS)), out_dir=tmp_path / "tok")
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    text = "What is the capital of France? ünïcode 🙂"
    assert loaded(text)["input_ids"] == a(text)["input_ids"]
    assert loaded.decode(a(text)["input_ids"]) == text
    assert loaded.chat_template == TINY_CHAT_TEMPLATE
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token_id == 0


def test_tiny_tokenizer_spare_ids_sit_at_the_top_and_never_encode_text() -> None:
    tok = _tokenizer()
    spare = spare_token_ids(tok)
    assert spare == tuple(range(len(tok) - len(spare), len(tok)))
    for text in [*CORPUS, "<|im_start|>user\nzzz qqq 123<|im_end|>"]:
        assert not set(tok(text)["input_ids"]) & set(spare)


# -- datasets ----------------------------------------------------------------------------------


def test_build_dataset_counts_used_and_skipped_with_reasons(tmp_path: Path) -> None:
    long_prompt = "hello world " * 40
    path = _write(
        tmp_path / "train.jsonl",
        [
            _openai(("user", "What is the capital of France?"), ("assistant", "Paris, France.")),
            "not json",
            # the answer starts after training_seq_len: nothing left to supervise
            _openai(("user", long_prompt), ("assistant", "The capital of France is Paris.")),
            _openai(("user", "a joke?"), ("assistant", "Why did the cat sit on the computer?")),
        ],
    )
    dataset = build_dataset(_plan(tmp_path, path, seq_len=64), _tokenizer())
    assert len(dataset) == 2
    stats = dataset.stats
    assert stats.conversations_used == 2
    assert [(s.line, s.kind) for s in stats.skipped] == [
        (2, "invalid JSON"),
        (3, "nothing to supervise"),
    ]
    assert "training_seq_len=64" in stats.skipped[1].reason
    assert stats.num_tokens == sum(len(e.input_ids) for e in dataset.examples)
    assert 0 < stats.num_supervised_tokens < stats.num_tokens
    assert "used 2 conversations, skipped 2: 1 invalid JSON (line 2)" in dataset.summary
    assert dataset.pad_token_id == 0


def test_build_dataset_uses_the_plans_chat_template_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [_openai(("user", "hi"), ("assistant", "hello world"))])
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_CHATML, encoding="utf-8")
    dataset = build_dataset(_plan(tmp_path, path, chat_template=template), _tokenizer())
    assert _supervised_text(_tokenizer(), dataset.examples[0]) == [
        "<think>\n\n</think>\n\nhello world<|im_end|>"
    ]
    with pytest.raises(DataError, match=r"cannot read data.chat_template .*missing.jinja"):
        build_dataset(_plan(tmp_path, path, chat_template=tmp_path / "missing.jinja"), _tokenizer())


def test_build_dataset_without_usable_data_fails_with_reasons(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.data_path is not set"):
        build_dataset(_plan(tmp_path, None), _tokenizer())
    path = _write(tmp_path / "short.jsonl", [_openai(("user", "hi"), ("assistant", "ok"))])
    with pytest.raises(DataError) as info:
        build_dataset(_plan(tmp_path, path, block_size=16), _tokenizer())
    assert "used 0 conversations, skipped 1: 1 nothing to supervise (line 1)" in str(info.value)
    assert "line 1: no block of 16 tokens" in str(info.value)


def test_build_dataset_needs_a_chat_template(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer(CORPUS)
    tok.chat_template = None
    path = _write(tmp_path / "t.jsonl", [_openai(("user", "hi"), ("assistant", "hello world"))])
    with pytest.raises(
        DataError, match=r"no usable chat template \(none\); set data\.chat_template"
    ):
        build_dataset(_plan(tmp_path, path), tok)


# -- batches -----------------------------------------------------------------------------------


def _synthetic(n: int) -> TrainDataset:
    """Example i has i % 5 + 2 tokens, all equal to i, the first one unsupervised."""
    examples = tuple(TokenizedExample([i] * (i % 5 + 2), [0] + [1] * (i % 5 + 1)) for i in range(n))
    stats = DatasetStats(n, (), 0, 0, 0)
    return TrainDataset(examples, pad_token_id=-1, stats=stats, source=Path("x.jsonl"))


def _ids(batch_list: list[torch.Tensor]) -> list[int]:
    return [int(row[0]) for batch in batch_list for row in batch]


def test_batches_are_right_padded_with_matching_masks() -> None:
    dataset = _synthetic(7)
    batch = next(batches(dataset, batch_size=3, seed=0, epoch=0))
    lengths = batch.attention_mask.sum(dim=1).tolist()
    assert batch.input_ids.shape == (3, max(lengths))
    for row, n in enumerate(lengths):
        example = dataset.examples[int(batch.input_ids[row, 0])]
        assert batch.input_ids[row, :n].tolist() == example.input_ids
        assert batch.loss_mask[row, :n].tolist() == example.loss_mask
        assert (batch.input_ids[row, n:] == -1).all()
        assert (batch.attention_mask[row, n:] == 0).all() and (batch.loss_mask[row, n:] == 0).all()
    assert batch.input_ids.dtype == batch.attention_mask.dtype == batch.loss_mask.dtype
    assert batch.input_ids.dtype == torch.long


def test_epoch_order_is_seeded_and_covers_every_example_once() -> None:
    dataset = _synthetic(10)
    first = _ids([b.input_ids for b in batches(dataset, batch_size=3, seed=5, epoch=0)])
    again = _ids([b.input_ids for b in batches(dataset, batch_size=3, seed=5, epoch=0)])
    second_epoch = _ids([b.input_ids for b in batches(dataset, batch_size=3, seed=5, epoch=1)])
    other_seed = _ids([b.input_ids for b in batches(dataset, batch_size=3, seed=6, epoch=0)])
    assert first == again
    assert sorted(first) == list(range(10))  # the last batch has 1 example
    assert first != second_epoch and sorted(second_epoch) == list(range(10))
    assert first != other_seed
    assert first == epoch_order(10, seed=5, epoch=0)


def test_resuming_from_a_saved_position_continues_the_same_sequence() -> None:
    dataset = _synthetic(11)
    full = list(batches(dataset, batch_size=2, seed=1, epoch=3))
    saved = full[2].next_index
    resumed = list(batches(dataset, batch_size=2, seed=1, epoch=3, start_index=saved))
    assert len(resumed) == len(full) - 3
    for a, b in zip(resumed, full[3:], strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and a.next_index == b.next_index
    assert full[-1].next_index == 11 and all(b.epoch == 3 for b in full)


def test_data_parallel_ranks_split_each_global_batch() -> None:
    dataset = _synthetic(13)
    single = list(batches(dataset, batch_size=4, seed=2, epoch=0, drop_last=True))
    rank0 = list(batches(dataset, batch_size=2, seed=2, epoch=0, rank=0, world_size=2))
    rank1 = list(batches(dataset, batch_size=2, seed=2, epoch=0, rank=1, world_size=2))
    assert len(single) == len(rank0) == len(rank1) == 3  # 13 // 4; the rest is dropped
    for whole, a, b in zip(single, rank0, rank1, strict=True):
        assert _ids([whole.input_ids]) == _ids([a.input_ids]) + _ids([b.input_ids])
        assert whole.next_index == a.next_index == b.next_index
    assert batches_per_epoch(13, batch_size=2, world_size=2) == 3
    assert batches_per_epoch(13, batch_size=4) == 4
    assert batches_per_epoch(13, batch_size=4, drop_last=True) == 3


def test_a_real_batch_flows_through_anchors_labels_and_the_loss(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        [
            _openai(("user", "What is the capital of France?"), ("assistant", CORPUS[1])),
            _openai(("user", "a joke?"), ("assistant", CORPUS[2])),
        ],
    )
    plan = _plan(tmp_path, path, block_size=4)
    tok = _tokenizer()
    batch = next(batches(build_dataset(plan, tok), batch_size=2, seed=0, epoch=0))
    anchors = sample_anchors(
        batch.loss_mask,
        batch.attention_mask,
        block_size=4,
        num_anchors=3,
        generator=torch.Generator().manual_seed(0),
    )
    assert anchors.valid.all()  # both answers are long enough for 3 blocks
    # every anchor is an answer token
    assert (torch.gather(batch.loss_mask, 1, anchors.anchors) == 1).all()
    mask_id = spare_token_ids(tok)[0]
    block_ids, positions = block_inputs(
        batch.input_ids, anchors.anchors, anchors.valid, block_size=4, mask_token_id=mask_id
    )
    assert block_ids.shape == positions.shape == (2, 12)
    labels, label_mask = block_labels(
        batch.input_ids, batch.loss_mask, anchors.anchors, anchors.valid, block_size=4
    )
    expected = torch.gather(batch.input_ids, 1, positions).view(2, 3, 4)
    assert torch.equal(labels[label_mask], expected[label_mask])
    logits = torch.randn(2, 3, 4, len(tok), requires_grad=True)
    out = dflash_loss(logits, labels, label_mask, objective=plan.draft.objective)
    torch.autograd.backward(out.loss)
    assert torch.isfinite(out.loss) and out.per_position_count[1] == 6


_RANK = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
sys.path.insert(0, str(Path(sys.argv[3]).parent.parent))
from test_train_dataset import _tokenizer
from testkit.tiny import tiny_plan
from dflash_recipes.data import sources
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data import token_cache, train_dataset
from dflash_recipes.executor.dist_env import (
    detect_dist_env, init_distributed, shutdown_distributed,
)
env = detect_dist_env("cpu")
hashed = []
def counting(source):  # the one function that reads the whole input to hash it
    hashed.append(env.rank)
    if sys.argv[4] == "unreadable":
        raise DataError("data file cannot be read: Permission denied")
    return sources.content_sha256(source)
train_dataset.content_sha256 = token_cache.content_sha256 = counting
init_distributed(env)
plan = tiny_plan(Path(sys.argv[1]), data_path=sys.argv[2], training_seq_len=64, num_proc=1)
try:
    dataset = train_dataset.build_dataset(plan, _tokenizer(), env=env)
    result = {"hashed": len(hashed), "n": len(dataset), "first": dataset.examples[0].input_ids}
except DataError as exc:
    result = {"error": str(exc)}
shutdown_distributed()
print(json.dumps(result))
"""


@pytest.mark.parametrize("case", ["readable", "unreadable"])
def test_under_torchrun_rank_0_alone_hashes_the_input(tmp_path: Path, case: str) -> None:
    import sys

    from testkit.ranks import run_ranks

    turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    data = _write(tmp_path / "d.jsonl", [json.dumps({"messages": turns})] * 5)
    here = str(Path(__file__).parent)
    argv = [sys.executable, "-c", _RANK, str(tmp_path / "run"), str(data), here, case]
    results = []
    for rank in run_ranks(argv):
        assert rank.returncode == 0, rank.stderr[-3000:]
        results.append(json.loads(rank.stdout.strip().splitlines()[-1]))
    if case == "readable":
        assert [r["hashed"] for r in results] == [1, 0]
        assert results[0]["n"] == results[1]["n"] == 5
        assert results[0]["first"] == results[1]["first"]
    else:  # rank 0 cannot hash it: both ranks stop with an error, neither waits forever
        assert "Permission denied" in results[0]["error"]
        assert "rank 0 could not read the data" in results[1]["error"]
