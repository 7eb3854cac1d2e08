"""The family matrix (issue 48): a tiny random target of every supported model family taken
through the product as a user would, and the "Target families" table of docs/dflash.md checked
against what these tests observe.

Per family (:data:`testkit.families.FAMILIES`; a family the installed transformers lacks is
skipped with the reason):

- the CLI journey: `init` writes a recipe from the base model, `compile` and a few steps of
  `run` with `data.packing` on and off (a target whose layers carry state across tokens must
  have packing refused at compile, and `init` must write `packing: false` for it), `export`,
  and a lossless `eval`;
- packing isolation: a packed row of two conversations gives each one the tapped states and
  logits it gets alone, through the product's `target_states` (what training reads);
- the docs row: class, attention implementation, layer types, packing and eval as observed
  equal the family's row of the table.

Windows and chunks (8 tokens) are shorter than every conversation (27-38 tokens) and every
eval prompt plus its answer, so sliding and chunked layers really cut.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from click.testing import Result
from safetensors.torch import load_file
from testkit.cli_runner import cli
from testkit.families import (
    DEMO_TARGET,
    EOS_TOKEN_ID,
    FAMILIES,
    MASK_TOKEN_ID,
    VOCAB_SIZE,
    WINDOW,
    Family,
    build_target,
    missing_reason,
    write_chat_data,
    write_target,
)
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dflash_recipes.executor.evaluation.speculative import DraftContext
from dflash_recipes.executor.model import target_states as target_states_module
from dflash_recipes.executor.model.masks import document_causal_mask
from dflash_recipes.executor.model.target_states import document_position_ids
from dflash_recipes.plan.run_plan import RunPlan

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "dflash.md"
SECTION = "## Target families"

BLOCK_SIZE = 4
MAX_STEPS = 2
#: Two conversations fit a packed row (each is 27-38 tokens).
SEQ_LEN = 80
#: What every run of the matrix overrides in the recipe `init` writes: a CPU-sized run.
#: float32: the recipe's bfloat16 would make greedy decoding a matter of rounding ties.
RUN_OVERRIDES = (
    "model.dtype=float32",
    "data.num_proc=1",
    f"training.max_steps={MAX_STEPS}",
    f"training.save_steps={MAX_STEPS}",
    "training.logging_steps=1",
    f"training.training_seq_len={SEQ_LEN}",
    "training.per_device_train_batch_size=2",
    f"dflash.dflash_block_size={BLOCK_SIZE}",
    "dflash.dflash_num_anchors=4",
)
#: Relative error under which two float32 states are the same (isolated rows agree to ~1e-6).
SAME = 1e-4

FAMILY_PARAMS = [
    pytest.param(
        family,
        id=family.name,
        marks=pytest.mark.skipif(
            missing_reason(family) is not None, reason=missing_reason(family) or ""
        ),
    )
    for family in FAMILIES
]

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _ok(result: Result, what: str) -> Result:
    assert result.exit_code == 0, f"{what} exited {result.exit_code}:\n{result.output}"
    return result


def _init(target: Path, data: Path, out: Path, recipe: Path) -> dict[str, object]:
    """`dflash-recipe init` for a new drafter of `target`; the recipe it wrote, parsed."""
    _ok(
        cli(
            "init",
            "--base-model",
            str(target),
            "--mask-token-id",
            str(MASK_TOKEN_ID),
            "--data-path",
            str(data),
            "--output-dir",
            str(out),
            "-o",
            str(recipe),
        ),
        "init",
    )
    written = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    assert isinstance(written, dict)
    return written


def _packing(written: dict[str, object]) -> object:
    """The `data.packing` of a recipe `init` wrote."""
    data = written["data"]
    assert isinstance(data, dict)
    return data["packing"]


def _refusal(cell: str) -> str | None:
    """The diagnostic code of a docs packing cell "refused (CODE)", None for "isolated"."""
    if cell == "isolated":
        return None
    refused = re.fullmatch(r"refused \(([a-z0-9-]+)\)", cell)
    assert refused is not None, f"a packing cell is 'isolated' or 'refused (CODE)': {cell!r}"
    return refused.group(1)


def _json_document(stdout: str) -> dict[str, object]:
    """The JSON object a ``--json`` / ``--format json`` command printed. click 8.1 (the floor
    leg's) mixes stderr into a test runner's stdout, where a library may warn first (Qwen3-Next's
    slow-kernel notes): the document starts at the first line that opens an object."""
    start = 0 if stdout.startswith("{") else stdout.index("\n{") + 1
    document, _ = json.JSONDecoder().raw_decode(stdout[start:])
    assert isinstance(document, dict)
    return document


def _compile(recipe: Path, plan: Path, *overrides: str) -> tuple[int, list[str], Result]:
    """`dflash-recipe compile RECIPE OVERRIDES -o PLAN --format json`: the exit code, the
    codes of its errors, and the result."""
    result = cli("compile", str(recipe), *overrides, "-o", str(plan), "--format", "json")
    payload = _json_document(result.stdout)
    errors = [d["code"] for d in payload["diagnostics"] if d["severity"] == "error"]
    return result.exit_code, errors, result


def _train_rows(run_dir: Path) -> list[dict[str, object]]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    return [row for row in rows if row["kind"] == "train"]


def _run(plan: Path, run_dir: Path) -> None:
    """`dflash-recipe run PLAN`: exit 0, every step logged with a finite loss, a checkpoint."""
    result = _ok(cli("run", str(plan), "--no-progress"), f"run {plan.name}")
    assert f"done: {MAX_STEPS} steps" in result.output, result.output
    rows = _train_rows(run_dir)
    assert [row["step"] for row in rows] == list(range(1, MAX_STEPS + 1))
    for row in rows:
        for key in ("loss", "grad_norm"):
            value = row[key]
            assert isinstance(value, float) and math.isfinite(value), (key, row)
    assert (run_dir / f"checkpoint-{MAX_STEPS:08d}" / "model.safetensors").is_file()


def _tokenizer() -> PreTrainedTokenizerBase:
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        str(DEMO_TARGET), local_files_only=True
    )
    return tokenizer


def _conversations(data: Path, count: int) -> list[list[dict[str, str]]]:
    lines = data.read_text(encoding="utf-8").splitlines()[:count]
    return [json.loads(line)["messages"] for line in lines]


def _token_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], *, prompt: bool
) -> list[int]:
    """A conversation rendered by the chat template: whole, or its prompt (the turns before
    the assistant's and the generation prompt), as `eval` renders it."""
    if prompt:
        messages = [m for m in messages if m["role"] != "assistant"]
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=prompt
    )
    assert isinstance(encoded, Mapping)
    ids = encoded["input_ids"]
    assert isinstance(ids, list)
    return [int(i) for i in ids]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# ---------------------------------------------------------------------------------------------
# the docs table
# ---------------------------------------------------------------------------------------------

COLUMNS = (
    "model_type",
    "config class",
    "model class",
    "attention implementation",
    "layer types",
    "packing",
    "eval",
)


def docs_rows(docs: Path = DOCS) -> dict[str, dict[str, str]]:
    """The rows of the first table under "## Target families" in docs/dflash.md, by
    model_type, each a dict of :data:`COLUMNS` (code spans unwrapped)."""
    text = docs.read_text(encoding="utf-8")
    assert SECTION in text.splitlines(), f"docs/dflash.md has no {SECTION!r} section"
    section = text.split(f"\n{SECTION}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [_cell(c) for c in lines[0].strip("|").split("|")]
    assert tuple(header) == COLUMNS, header
    rows: dict[str, dict[str, str]] = {}
    for line in lines[2:]:
        cells = [_cell(c) for c in line.strip().strip("|").split(" | ")]
        row = dict(zip(COLUMNS, cells, strict=True))
        assert row["model_type"] not in rows, f"two rows for {row['model_type']}"
        rows[row["model_type"]] = row
    return rows


def _cell(text: str) -> str:
    return re.sub(r"`([^`]*)`", r"\1", text.strip())


def describe_layer_types(config: object, layers: int) -> str:
    """The attention layer kinds a config declares, in order of first appearance: its
    `layer_types`, else one window for every layer when it sets `sliding_window` (Mistral's
    rule), else full attention."""
    declared = getattr(config, "layer_types", None)
    if declared:
        kinds = list(declared)
    elif getattr(config, "sliding_window", None):
        kinds = ["sliding_attention"] * layers
    else:
        kinds = ["full_attention"] * layers
    names = [kind.removesuffix("_attention") for kind in dict.fromkeys(kinds)]
    return " + ".join(names)


def test_the_docs_table_has_one_row_per_family_of_the_matrix() -> None:
    rows = docs_rows()
    assert list(rows) == [family.name for family in FAMILIES]
    for family in FAMILIES:
        assert rows[family.name]["config class"] == family.config_class


def test_every_family_name_is_its_model_type() -> None:
    # The docs' first column is the model_type of config.json; the registry's name is the id.
    for family in FAMILIES:
        if missing_reason(family) is None:
            assert family.config().model_type == family.name


def test_docs_rows_are_parsed_cell_by_cell(tmp_path: Path) -> None:
    """The parser the row checks rely on: a changed cell changes the parsed row."""
    rows = docs_rows()
    text = DOCS.read_text(encoding="utf-8")
    first = FAMILIES[0].name
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| `{first}` |"))
    edited = tmp_path / "dflash.md"
    edited.write_text(text.replace(line, line.replace(" lossless |", " lossy |")), "utf-8")
    assert docs_rows(edited)[first]["eval"] == "lossy" != rows[first]["eval"]
    assert docs_rows(edited)[first] == {**rows[first], "eval": "lossy"}


# ---------------------------------------------------------------------------------------------
# the CLI journey
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def family_files(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, Path]]:
    """(target directory, chat JSONL) of the test's family, in tmp_path."""
    family: Family = request.getfixturevalue("family")
    yield write_target(family, tmp_path / "target"), write_chat_data(tmp_path / "chat.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_init_compile_run_export_eval(
    family: Family, family_files: tuple[Path, Path], tmp_path: Path
) -> None:
    target, data = family_files
    packed_out, padded_out = tmp_path / "runs" / "packed", tmp_path / "runs" / "padded"
    recipe = tmp_path / "recipe.yaml"
    refusal = _refusal(docs_rows()[family.name]["packing"])
    written = _init(target, data, packed_out, recipe)
    assert _packing(written) is (refusal is None), "the data.packing init writes"

    # packing on: compiled and trained, or refused at compile when the target cannot pack
    packed_plan = tmp_path / "packed.json"
    code, errors, result = _compile(recipe, packed_plan, *RUN_OVERRIDES, "data.packing=true")
    if refusal is None:
        assert (code, errors) == (0, []), result.output
        _run(packed_plan, packed_out)
    else:
        assert (code, errors) == (1, [refusal]), result.output
        assert not packed_plan.exists()

    # packing off: every family trains
    padded_plan = tmp_path / "padded.json"
    code, errors, result = _compile(
        recipe,
        padded_plan,
        *RUN_OVERRIDES,
        "data.packing=false",
        f"training.output_dir={padded_out}",
    )
    assert (code, errors) == (0, []), result.output
    _run(padded_plan, padded_out)

    # export a checkpoint as a user would, with the run's plan.json found next to it
    checkpoint = padded_out / f"checkpoint-{MAX_STEPS:08d}"
    exported = tmp_path / "exported"
    _ok(cli("export", str(checkpoint), str(exported)), "export")
    weights = load_file(str(exported / "model.safetensors"))
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert weights.keys() == saved.keys()
    assert all(torch.equal(weights[k], saved[k]) for k in weights)
    config = json.loads((exported / "config.json").read_text(encoding="utf-8"))
    plan = RunPlan.from_json((padded_out / "plan.json").read_text(encoding="utf-8"))
    taps = plan.resolved_draft().target_layer_ids
    assert config["dflash_config"]["target_layer_ids"] == list(taps)
    assert config["dflash_config"]["mask_token_id"] == MASK_TOKEN_ID

    # eval: speculative decoding whose output equals the target's greedy decoding
    result = _ok(
        cli(
            "eval",
            str(padded_out / "plan.json"),
            "--checkpoint",
            str(exported),
            "--prompts",
            str(data),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "10",
            "--json",
        ),
        "eval",
    )
    report = _json_document(result.stdout)
    assert report["lossless"] is True, report
    assert report["mismatched_prompts"] == []
    assert report["num_prompts"] == 2 and report["tokens"] > 0
    assert 1.0 <= report["tau"] <= BLOCK_SIZE


# ---------------------------------------------------------------------------------------------
# packing isolation, through the product's target_states
# ---------------------------------------------------------------------------------------------


def packed_row(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[list[dict[str, str]]]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The conversations' token ids, one `[1, n]` tensor each, and the document ids of the
    row packing them end to end."""
    documents = [torch.tensor([_token_ids(tokenizer, c, prompt=False)]) for c in conversations]
    document_ids = torch.cat(
        [torch.full_like(ids, number) for number, ids in enumerate(documents)], dim=1
    )
    return documents, document_ids


def isolation_errors(
    model: PreTrainedModel,
    documents: Sequence[torch.Tensor],
    document_ids: torch.Tensor | None,
) -> list[float]:
    """Per document, the relative error between its tapped states (every decoder layer) and
    logits in the packed row and the same run alone; `document_ids` None packs the row as
    one causal sequence (the control: the later documents then see the earlier ones)."""
    from dflash_recipes.executor.model.target_states import target_states

    taps = list(range(model.config.num_hidden_layers))
    row = torch.cat(list(documents), dim=1)
    with torch.no_grad():
        packed = target_states(
            model,
            row,
            torch.ones_like(row),
            taps,
            with_logits=True,
            document_ids=document_ids,
        )
        errors = []
        start = 0
        for ids in documents:
            alone = target_states(model, ids, torch.ones_like(ids), taps, with_logits=True)
            part = slice(start, start + ids.shape[1])
            assert packed.logits is not None and alone.logits is not None
            errors.append(
                max(
                    _relative(packed.tapped[:, part], alone.tapped),
                    _relative(packed.logits[:, part], alone.logits),
                )
            )
            start += ids.shape[1]
    return errors


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_a_packed_row_gives_each_conversation_its_own_states(
    family: Family, tmp_path: Path
) -> None:
    from dflash_recipes.errors import PlanError

    model = build_target(family)
    tokenizer = _tokenizer()
    conversations = _conversations(write_chat_data(tmp_path / "chat.jsonl"), 2)
    documents, document_ids = packed_row(tokenizer, conversations)
    assert all(ids.shape[1] > 3 * WINDOW for ids in documents)  # past every window and chunk
    # the control: one causal row leaks the first conversation into the second
    control = isolation_errors(model, documents, None)
    assert control[0] < SAME < control[1], control
    isolated = docs_rows()[family.name]["packing"] == "isolated"
    try:
        errors = isolation_errors(model, documents, document_ids)
    except PlanError as exc:
        assert not isolated, f"target_states refuses the packed row: {exc}"
        return
    if isolated:
        assert max(errors) < SAME, f"packed states differ from each conversation alone: {errors}"
    else:
        assert max(errors) > SAME, "packing is refused for a target whose packed rows isolate"


# ---------------------------------------------------------------------------------------------
# the docs row, observed
# ---------------------------------------------------------------------------------------------


class CyclingOracle:
    """Knows each prompt's greedy continuation; its step ``i`` proposes the first
    ``i % block_size`` tokens right and the rest wrong, so every step rejects at another block
    position and some accept the whole block (each crop of the target's cache is exercised)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], block_size: int) -> None:
        self.continuations = continuations
        self.block_size = block_size
        self.steps: dict[tuple[int, ...], int] = {}

    def propose(self, context: DraftContext) -> list[int]:
        committed = list(context.committed)
        prompt = next(p for p in self.continuations if committed[: len(p)] == list(p))
        full = [*prompt, *self.continuations[prompt]]
        step = self.steps.get(prompt, 0)
        self.steps[prompt] = step + 1
        right = full[len(committed) : len(committed) + self.block_size - 1]
        good = step % self.block_size
        return [t if k < good else (t + 1) % VOCAB_SIZE for k, t in enumerate(right)]


def greedy_decoding(model: PreTrainedModel, prompt: Sequence[int], n: int) -> list[int]:
    """`n` greedy tokens of the target, every one from a full forward without a cache."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([sequence]), use_cache=False).logits
            sequence.append(int(logits[0, -1].argmax()))
    return sequence[len(prompt) :]


def observed_eval(model: PreTrainedModel, plan: RunPlan, prompts: list[list[int]]) -> str:
    """ "lossless" when eval's verification loop, fed drafts that are accepted 0 to B-1 at a
    time, decodes exactly the target's greedy tokens; else what differs."""
    from dflash_recipes.executor.evaluation.cached_decoding import speculative_generate_batch

    spec = plan.resolved_draft()
    new = 16
    reference = {tuple(p): greedy_decoding(model, p, new + spec.block_size) for p in prompts}
    oracle = CyclingOracle(reference, spec.block_size)
    results = speculative_generate_batch(
        model, oracle, spec, prompts, max_new_tokens=new, eos_token_id=None
    )
    problems = []
    for number, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        expected = reference[tuple(prompt)][:new]
        if result.tokens != expected:
            pairs = zip(result.tokens, expected, strict=False)
            first = next(
                (i for i, (a, b) in enumerate(pairs) if a != b),
                min(len(result.tokens), len(expected)),
            )
            problems.append(f"prompt {number} leaves greedy decoding at token {first}")
    if problems:
        return "; ".join(problems)
    taus = [tau for result in results for tau in result.accepted_per_step]
    assert max(taus) == spec.block_size and min(taus) == 1, taus  # every crop exercised
    return "lossless"


def observed_packing(
    written: dict[str, object], compiled: tuple[int, list[str]], model: PreTrainedModel
) -> str:
    """ "isolated" when init writes packing: true, compile accepts it and the run-start check
    (`check_packed_isolation`) passes on the target; "refused (CODE)" when init writes
    packing: false and compile refuses it with CODE; else what each of them did."""
    from dflash_recipes.errors import PlanError
    from dflash_recipes.executor.model.target_states import check_packed_isolation

    init_packs = _packing(written)
    code, errors = compiled
    if code != 0:
        verdict = f"refused ({', '.join(errors)})"
        return verdict if init_packs is False else f"{verdict}, but init writes packing: true"
    taps = list(range(model.config.num_hidden_layers))
    try:
        check_packed_isolation(model, taps, with_logits=True)
    except PlanError as exc:
        return f"compile accepts packing, but the run-start check refuses it: {exc}"
    return "isolated" if init_packs is True else "isolated, but init writes packing: false"


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_the_docs_row_is_what_the_family_does(
    family: Family, family_files: tuple[Path, Path], tmp_path: Path
) -> None:
    from dflash_recipes.executor.model.convert import load_base_model

    target, data = family_files
    recipe = tmp_path / "recipe.yaml"
    written = _init(target, data, tmp_path / "run", recipe)
    packed = _compile(recipe, tmp_path / "packed.json", *RUN_OVERRIDES, "data.packing=true")
    code, errors, result = _compile(
        recipe, tmp_path / "plan.json", *RUN_OVERRIDES, "data.packing=false"
    )
    assert (code, errors) == (0, []), result.output
    plan = RunPlan.from_json((tmp_path / "plan.json").read_text(encoding="utf-8"))
    model = load_base_model(plan)  # as run and eval load it
    config = model.config
    assert (config.model_type, config.vocab_size, config.eos_token_id) == (
        family.name,
        VOCAB_SIZE,
        EOS_TOKEN_ID,
    )
    tokenizer = _tokenizer()
    prompts = [_token_ids(tokenizer, c, prompt=True) for c in _conversations(data, 2)]
    observed = {
        "model_type": config.model_type,
        "config class": type(config).__name__,
        "model class": type(model).__name__,
        "attention implementation": config._attn_implementation,
        "layer types": describe_layer_types(config, config.num_hidden_layers),
        "packing": observed_packing(written, packed[:2], model),
        "eval": observed_eval(model, plan, prompts),
    }
    row = docs_rows()[family.name]
    if _release() < TABLE_RELEASE:
        # a transformers default, not ours: older releases load Gemma 2 with SDPA
        del observed["attention implementation"], row["attention implementation"]
    assert observed == row


#: The transformers release the table's attention implementations were observed on.
TABLE_RELEASE = (5, 25)


def _release() -> tuple[int, int]:
    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


# ---------------------------------------------------------------------------------------------
# the start-up isolation check of a packed run
# ---------------------------------------------------------------------------------------------


def _leaking_packing(
    model: torch.nn.Module, document_ids: torch.Tensor, *, dtype: torch.dtype
) -> tuple[object, torch.Tensor]:
    """What packing did before issue 48: one 4-D boolean block-diagonal mask for every layer
    (eager attention adds it, a sliding-window layer loses its window)."""
    del model, dtype
    return document_causal_mask(document_ids), document_position_ids(document_ids)


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss", "mistral"])
def test_a_packed_run_that_would_leak_stops_before_its_first_step(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    family = next(f for f in FAMILIES if f.name == name)
    reason = missing_reason(family)
    if reason is not None:
        pytest.skip(reason)
    target = write_target(family, tmp_path / "target")
    data = write_chat_data(tmp_path / "chat.jsonl")
    out, recipe, plan = tmp_path / "run", tmp_path / "recipe.yaml", tmp_path / "plan.json"
    _init(target, data, out, recipe)
    code, errors, result = _compile(recipe, plan, *RUN_OVERRIDES, "data.packing=true")
    assert (code, errors) == (0, []), result.output

    monkeypatch.setattr(target_states_module, "packed_attention", _leaking_packing)
    refused = cli("run", str(plan), "--no-progress")
    assert refused.exit_code == 1, refused.output
    assert "packing would train on states the target never produces" in refused.output
    assert "Set data.packing=false" in refused.output
    assert not list(out.glob("checkpoint-*"))  # stopped before any step
    assert not (out / "metrics.jsonl").exists() or _train_rows(out) == []

    monkeypatch.undo()
    done = _ok(cli("run", str(plan), "--no-progress"), "run")
    assert re.search(r"packing isolation check: a packed row of \d+ \+ \d+ tokens", done.output)
    assert _train_rows(out)  # the same plan trains once the isolation holds
