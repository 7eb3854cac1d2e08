"""Eval prompt files (chat JSONL, JSON lists, Parquet columns), thinking mode, the recorded
settings that make tau comparable, and the eval command's new options (issue 26)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from testkit.cli_runner import cli
from testkit.tiny import saved_eval_setup
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from dflash_recipes.errors import DataError
from dflash_recipes.executor.demo.tiny_tokenizer import build_tiny_tokenizer
from dflash_recipes.executor.evaluation.evaluate import load_prompts, run_eval
from dflash_recipes.executor.evaluation.prompt_files import read_json_prompts, read_parquet_prompts
from dflash_recipes.plan.run_plan import RunPlan

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a drafter proposes a block and the target verifies it",
    "speculative decoding is lossless when verification is greedy",
]
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the lazy dog"},
    {"role": "assistant", "content": "jumps"},
]
#: A template that renders differently with enable_thinking false.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    "assistant:"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return build_tiny_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunPlan, Path]:
    return saved_eval_setup(tmp_path_factory.mktemp("eval_prompts"), TEXTS)


def write_json(path: Path, value: object) -> Path:
    path.write_text(json.dumps(value), encoding="utf-8")
    return path


def test_json_and_parquet_prompts_give_the_jsonl_prompts(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        json.dumps({"messages": [{"role": "user", "content": TEXTS[0]}]})
        + "\n"
        + json.dumps({"messages": MESSAGES})
        + "\n"
    )
    as_json = write_json(tmp_path / "p.json", [TEXTS[0], MESSAGES])
    sharegpt = write_json(
        tmp_path / "s.json",
        [
            [{"from": "human", "value": TEXTS[0]}],
            [{"from": m["role"], "value": m["content"]} for m in MESSAGES],
        ],
    )
    parquet = tmp_path / "p.parquet"
    pq.write_table(
        pa.table(
            {"id": [1, 2], "prompt": [TEXTS[0], TEXTS[0]], "messages": [MESSAGES[1:2], MESSAGES]}
        ),
        parquet,
    )
    expected = load_prompts(jsonl, tokenizer)
    assert len(expected) == 2
    assert load_prompts(as_json, tokenizer) == expected
    assert load_prompts(sharegpt, tokenizer) == expected
    # The default column is "prompt"; a message-list column is read as message lists.
    assert load_prompts(parquet, tokenizer) == [expected[0], expected[0]]
    messages = load_prompts(parquet, tokenizer, column="messages")
    assert messages[1] == expected[1]
    assert load_prompts(as_json, tokenizer, limit=1) == expected[:1]


def test_bad_prompt_files_say_where(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"item 2 must be a prompt string or a non-empty list"):
        read_json_prompts(write_json(tmp_path / "a.json", ["ok", 3]))
    with pytest.raises(DataError, match=r"item 1\[0\] needs a role"):
        read_json_prompts(write_json(tmp_path / "b.json", [[{"role": "robot", "content": "x"}]]))
    with pytest.raises(DataError, match="must hold a non-empty JSON list"):
        read_json_prompts(write_json(tmp_path / "c.json", {"prompts": ["x"]}))
    broken = tmp_path / "d.json"
    broken.write_text("[1,", encoding="utf-8")
    with pytest.raises(DataError, match="is not readable JSON"):
        read_json_prompts(broken)
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": [1], "text": ["x"]}), parquet)
    with pytest.raises(
        DataError, match=r"has no any of prompt, .*columns are id, text: pass --prompt-column"
    ):
        read_parquet_prompts(parquet)
    assert read_parquet_prompts(parquet, "text")[0].messages[0].content == "x"
    with pytest.raises(DataError, match=r"row 1 column 'id' must be a prompt string"):
        read_parquet_prompts(parquet, "id")
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello", encoding="utf-8")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_parquet_prompts(not_parquet)
    with pytest.raises(DataError, match=r"cannot tell its format from the suffix '\.txt'"):
        load_prompts(tmp_path / "prompts.txt", None)  # type: ignore[arg-type]


def test_enable_thinking_reaches_the_chat_template(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    prompts = write_json(tmp_path / "p.json", [TEXTS[1]])
    default = load_prompts(prompts, tokenizer, chat_template=THINKING_TEMPLATE)
    on = load_prompts(prompts, tokenizer, chat_template=THINKING_TEMPLATE, enable_thinking=True)
    off = load_prompts(prompts, tokenizer, chat_template=THINKING_TEMPLATE, enable_thinking=False)
    assert default == on != off
    assert "<no-think>" in tokenizer.decode(off[0])


def test_run_eval_records_what_makes_tau_comparable(
    eval_setup: tuple[RunPlan, Path], tmp_path: Path
) -> None:
    plan, export = eval_setup
    prompts = write_json(tmp_path / "bench_prompts.json", [TEXTS[0], MESSAGES, TEXTS[2]])
    report = run_eval(plan, export, prompts, max_new_tokens=5, num_prompts=8, batch_size=2)
    settings = report.settings
    assert settings is not None
    assert report.lossless
    assert settings.block_size == plan.draft.block_size
    assert settings.max_new_tokens == 5 and report.max_new_tokens == 5
    assert settings.num_prompts == 3 and settings.batch_size == 2
    assert settings.prompt_file == str(prompts)
    assert settings.prompt_file_sha256 == hashlib.sha256(prompts.read_bytes()).hexdigest()
    assert settings.prompt_format == "json"
    assert settings.chat_template_source == "tokenizer"
    template = AutoTokenizer.from_pretrained(plan.base_model.path).chat_template
    assert settings.chat_template_sha256 == hashlib.sha256(template.encode()).hexdigest()
    assert settings.enable_thinking is None and settings.thinking_mode == "template default"
    assert report.tokens_per_second > 0
    # One at a time measures the same (only the recorded batch size and the time differ).
    alone = run_eval(plan, export, prompts, max_new_tokens=5, num_prompts=8)
    assert alone.tau_per_prompt == report.tau_per_prompt
    assert alone.tokens == report.tokens and alone.steps == report.steps


def test_eval_command_json_carries_the_settings(
    eval_setup: tuple[RunPlan, Path], tmp_path: Path
) -> None:
    plan, export = eval_setup
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    prompts = write_json(tmp_path / "bench_prompts.json", [TEXTS[0], TEXTS[1], TEXTS[2]])
    result = cli(
        "eval",
        str(plan_file),
        "--checkpoint",
        str(export),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--batch-size",
        "3",
        "--disable-thinking",
        "--json",
    )
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["lossless"] is True
    assert row["num_prompts"] == 3 and row["max_new_tokens"] == 6
    assert {"tau_pooled", "tau_per_prompt_mean", "tokens_per_second"} <= set(row)
    settings = row["settings"]
    assert settings["enable_thinking"] is False and settings["thinking_mode"] == "off"
    assert settings["batch_size"] == 3 and settings["decoding"] == "greedy"
    assert settings["prompt_file_sha256"] == hashlib.sha256(prompts.read_bytes()).hexdigest()
    assert len(settings["chat_template_sha256"]) == 64

    # A prompt that cannot fit the target's positions: a clean error, no traceback.
    long = write_json(tmp_path / "long.json", [" ".join(["the"] * 400)])
    refused = cli("eval", str(plan_file), "--checkpoint", str(export), "--prompts", str(long))
    assert refused.exit_code != 0
    assert "max_position_embeddings" in refused.output
    assert "Traceback" not in refused.output


def _shape(line: str) -> str:
    """A console line with its figures, hashes and paths left out: what must not drift."""
    line = re.sub(r"\b[0-9a-f]{12}\b", "<sha>", line)
    line = re.sub(r"\d+(\.\d+)?", "<n>", line)
    return re.sub(r"<n>( <n>)+", "<n>...", line)


def test_the_readme_s_eval_sample_is_what_the_command_prints(
    eval_setup: tuple[RunPlan, Path], tmp_path: Path
) -> None:
    """Issue 36: "The README's `eval` console sample is out of date"; kept true line by line."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```console\n\$ dflash-recipe eval [^\n]*\n(.*?)```", readme, re.S)
    assert block is not None, "the README has no `dflash-recipe eval` console sample"
    sample = block.group(1).splitlines()
    plan, export = eval_setup
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    prompts = write_json(tmp_path / "prompts.json", [TEXTS[0], TEXTS[1]])
    result = cli(
        "eval", str(plan_file), "--checkpoint", str(export), "--prompts", str(prompts),
        "--max-new-tokens", "6",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    printed = [line for line in result.output.splitlines() if line.strip()]
    assert [_shape(line) for line in printed] == [_shape(line) for line in sample]


@pytest.mark.parametrize("kind", ["folder", "save_to_disk"])
def test_eval_command_takes_a_folder_or_a_save_to_disk_of_prompts(
    eval_setup: tuple[RunPlan, Path], tmp_path: Path, kind: str
) -> None:
    # issue 36: --prompts reads every training-data input, as the library and CHANGELOG promise
    import datasets

    from dflash_recipes.data.sources import content_sha256, resolve_source

    plan, export = eval_setup
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    rows = [{"messages": [{"role": "user", "content": text}]} for text in TEXTS]
    prompts = tmp_path / "prompts"
    if kind == "folder":
        prompts.mkdir()
        (prompts / "a.jsonl").write_text(json.dumps(rows[0]) + "\n", encoding="utf-8")
        pq.write_table(pa.Table.from_pylist(rows[1:]), prompts / "b.parquet")
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(prompts))
    result = cli(
        "eval", str(plan_file), "--checkpoint", str(export), "--prompts", str(prompts),
        "--max-new-tokens", "4", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["num_prompts"] == 3 and row["lossless"] is True
    settings = row["settings"]
    assert settings["prompt_format"] == "rows"
    expected = content_sha256(resolve_source(prompts, setting="--prompts"))
    assert settings["prompt_file_sha256"] == expected


def test_a_save_to_disk_folder_and_a_gzipped_jsonl_are_read_as_training_conversations(
    tmp_path: Path,
) -> None:
    import gzip

    import datasets

    from dflash_recipes.executor.evaluation.evaluate import read_prompt_conversations

    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(3)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    with gzip.open(tmp_path / "p.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("saved", "p.jsonl.gz"):
        got = read_prompt_conversations(tmp_path / name)
        assert [c.messages[0].content for c in got] == ["q0", "q1", "q2"], name
