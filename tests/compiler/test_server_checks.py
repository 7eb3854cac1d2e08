"""The sections that talk to a server, `regenerate:` and `target_server:`: validation, compile
cross-checks (no network), what the plan records, and keys."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from testkit.compiling import compile_in, only

from dflash_recipes.compiler.compilation import CompileResult, compile_file, compile_recipe
from dflash_recipes.compiler.server_checks import (
    TARGET_SERVER_STORAGE_MISSING,
    check_regenerate,
    check_target_server,
)
from dflash_recipes.diagnostics import Diagnostic, Severity
from dflash_recipes.errors import RecipeError
from dflash_recipes.files.regenerate_output import prompt_key
from dflash_recipes.recipe.loader import load_recipe
from dflash_recipes.recipe.sections import Recipe, RegenerateSection, TargetServerSection

RecipeFactory = Callable[..., Recipe]


def _with(recipe: Recipe, **fields: object) -> Recipe:
    return attrs.evolve(recipe, regenerate=RegenerateSection(**fields))  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _drafter(drafter: Path) -> Path:
    """The tiny recipes warm-start from `tmp_path/drafter`."""
    return drafter


def _compile(tmp_path: Path, recipe: Recipe, *, resolve: bool = True) -> CompileResult:
    return compile_recipe(recipe, base_dir=tmp_path, resolve=resolve)


def _only(result: CompileResult, code: str) -> Diagnostic:
    found = [d for d in result.diagnostics if d.code == code]
    assert len(found) == 1, result.diagnostics
    return found[0]


def test_a_recipe_without_the_section_compiles_to_a_plan_without_it(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    result = _compile(tmp_path, make_recipe(training={"training_seq_len": 128}))
    assert result.plan is not None and result.plan.regenerate is None
    assert "regenerate" not in [d.path.split(".")[0] for d in result.diagnostics]


def test_an_unset_max_new_tokens_is_the_training_length(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    recipe = _with(make_recipe(training={"training_seq_len": 128}), reasoning="drop")
    result = _compile(tmp_path, recipe)
    assert result.plan is not None and result.plan.regenerate is not None
    assert result.plan.regenerate.max_new_tokens == 128


def test_the_plan_carries_the_settings_with_an_absolute_output(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    recipe = _with(
        make_recipe(),
        base_url="http://localhost:8000/v1",
        model="Qwen/Qwen3-8B",
        max_concurrency=64,
        reasoning="drop",
        first_turn_only=True,
        max_new_tokens=1024,
        output_path="regen/out.jsonl",
    )
    result = _compile(tmp_path, recipe)
    assert result.plan is not None and result.plan.regenerate is not None
    settings = result.plan.regenerate
    assert settings.output_path == str(tmp_path / "regen" / "out.jsonl")
    assert (settings.base_url, settings.model, settings.max_concurrency) == (
        "http://localhost:8000/v1",
        "Qwen/Qwen3-8B",
        64,
    )
    assert settings.reasoning == "drop" and settings.first_turn_only
    again = type(result.plan).from_json(result.plan.to_json())
    assert again == result.plan


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("localhost:8000/v1", "must start with http:// or https://"),
        ("ftp://host/v1", "must start with http:// or https:// (scheme: ftp)"),
        ("http:///v1", "has no host name"),
        ("http://host:99999/v1", "is not a valid URL"),
        ("http://host:8000/v1/chat/completions", "is the chat endpoint itself"),
    ],
)
def test_a_bad_base_url_is_an_error_at_schema_level(
    tmp_path: Path, make_recipe: RecipeFactory, url: str, why: str
) -> None:
    result = _compile(tmp_path, _with(make_recipe(), base_url=url), resolve=False)
    assert result.plan is None
    found = _only(result, "regenerate-bad-url")
    assert found.path == "regenerate.base_url"
    assert why in found.message and repr(url) in found.message
    assert found.hint is not None and "http://localhost:8000/v1" in found.hint


def test_max_new_tokens_must_fit_training_seq_len(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    recipe = _with(make_recipe(training={"training_seq_len": 512}), max_new_tokens=2048)
    result = _compile(tmp_path, recipe, resolve=False)
    found = _only(result, "regenerate-max-new-tokens")
    assert found.path == "regenerate.max_new_tokens"
    assert "max_new_tokens is 2048 but training.training_seq_len is 512" in found.message
    assert found.hint is not None and "at most 512" in found.hint


def test_output_path_that_is_a_directory_or_unwritable_is_an_error(
    tmp_path: Path, make_recipe: RecipeFactory
) -> None:
    (tmp_path / "adir").mkdir()
    found = _only(
        _compile(tmp_path, _with(make_recipe(), output_path="adir")), "regenerate-output-unusable"
    )
    assert found.path == "regenerate.output_path"
    assert f"the output {tmp_path / 'adir'} is a directory" in found.message

    (tmp_path / "afile").write_text("x")
    found = _only(
        _compile(tmp_path, _with(make_recipe(), output_path="afile/out.jsonl")),
        "regenerate-output-unusable",
    )
    assert f"under {tmp_path / 'afile'}, which is a file" in found.message

    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        found = _only(
            _compile(tmp_path, _with(make_recipe(), output_path="locked/out.jsonl")),
            "regenerate-output-unusable",
        )
        assert "is not writable" in found.message


def test_output_path_equal_to_the_training_data_warns(
    tmp_path: Path, make_recipe: RecipeFactory, train_file: Path
) -> None:
    result = _compile(tmp_path, _with(make_recipe(), output_path=train_file.name))
    assert result.plan is not None  # training on the regenerated file is the point
    found = _only(result, "regenerate-output-is-data")
    assert found.severity is Severity.WARNING and found.path == "regenerate.output_path"
    assert "`dflash-recipe regenerate` would refuse to write over the prompts" in found.message
    assert found.hint == "to regenerate again, pass the prompts with --input FILE"


def test_api_key_env_unset_warns_and_a_key_is_refused_as_a_name(
    tmp_path: Path,
    make_recipe: RecipeFactory,
    monkeypatch: pytest.MonkeyPatch,
    write_recipe: Callable[..., Path],
) -> None:
    monkeypatch.delenv("DFLASH_TEST_KEY", raising=False)
    recipe = _with(make_recipe(), base_url="http://h:8000/v1", api_key_env="DFLASH_TEST_KEY")
    found = _only(_compile(tmp_path, recipe), "regenerate-api-key-unset")
    assert "names DFLASH_TEST_KEY, which is not set" in found.message
    monkeypatch.setenv("DFLASH_TEST_KEY", "secret")
    ok = _compile(tmp_path, recipe)
    assert ok.plan is not None and "secret" not in ok.plan.to_json()

    path = write_recipe(
        "model: {model_name_or_path: base}\nregenerate:\n  api_key_env: sk-abc123\n"
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    text = str(info.value)
    assert "regenerate.api_key_env" in text and "never the key itself" in text


def test_server_fields_without_a_base_url_warn(tmp_path: Path, make_recipe: RecipeFactory) -> None:
    result = _compile(tmp_path, _with(make_recipe(), model="x", max_retries=9), resolve=False)
    paths = sorted(d.path for d in result.diagnostics if d.code == "regenerate-server-field-unused")
    assert paths == ["regenerate.max_retries", "regenerate.model"]


def test_overrides_reach_the_section_and_bad_values_are_refused(
    write_recipe: Callable[..., Path], recipe_text: Callable[..., str], train_file: Path
) -> None:
    path = write_recipe(recipe_text())
    result = compile_file(path, ["regenerate.reasoning=drop"], resolve=False)
    assert result.plan is not None and result.plan.regenerate is not None
    assert result.plan.regenerate.reasoning == "drop"
    bad = compile_file(path, ["regenerate.reasoning=maybe"], resolve=False)
    assert bad.plan is None
    assert any("keep, separate, drop" in d.message for d in bad.diagnostics)


def test_prompt_key_depends_on_the_prompts_only() -> None:
    a = prompt_key([("user", "hi"), ("assistant", None)])
    assert a == prompt_key([("user", "hi"), ("assistant", None)])
    assert a != prompt_key([("user", "hi!"), ("assistant", None)])
    assert a != prompt_key([("system", "hi"), ("assistant", None)])
    assert a != prompt_key([("user", "hi"), ("assistant", None), ("user", "more")])


# -- each rule's words, and the boundaries of the rules -----------------------------------------


def test_each_section_finding_reads_word_for_word(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_ABSENT_KEY", raising=False)
    server = RegenerateSection(
        base_url="ftp://h/v1", api_key_env="DFLASH_ABSENT_KEY", max_new_tokens=513
    )
    found = check_regenerate(server, training_seq_len=512, output=None, source=None, resolve=True)
    assert [attrs.astuple(f) for f in found] == [
        (
            "regenerate-bad-url",
            Severity.ERROR,
            "regenerate.base_url",
            "regenerate.base_url 'ftp://h/v1' must start with http:// or https:// (scheme: ftp)",
            "set regenerate.base_url to the server's OpenAI API, e.g. http://localhost:8000/v1 "
            "(vLLM) or http://localhost:30000/v1 (SGLang)",
        ),
        (
            "regenerate-api-key-unset",
            Severity.WARNING,
            "regenerate.api_key_env",
            "regenerate.api_key_env names DFLASH_ABSENT_KEY, which is not set in this "
            "environment; requests would be sent without an API key",
            "export DFLASH_ABSENT_KEY=... before `dflash-recipe regenerate`, or set "
            "regenerate.api_key_env: null for a server without a key",
        ),
        (
            "regenerate-max-new-tokens",
            Severity.ERROR,
            "regenerate.max_new_tokens",
            "regenerate.max_new_tokens is 513 but training.training_seq_len is 512: longer "
            "answers would be cut off in training, so generating them wastes the server's time",
            "set regenerate.max_new_tokens to at most 512 (leave room for the prompt), or raise "
            "training.training_seq_len",
        ),
    ]
    local = RegenerateSection(model="m", max_new_tokens=512, request_timeout_s=5.0)
    found = check_regenerate(local, training_seq_len=512, output=None, source=None, resolve=True)
    assert [attrs.astuple(f) for f in found] == [
        (
            "regenerate-server-field-unused",
            Severity.WARNING,
            f"regenerate.{name}",
            f"regenerate.{name} is set but regenerate.base_url is not: answers are generated "
            f"locally with transformers, which ignores {name}",
            f"set regenerate.base_url to your server (e.g. http://localhost:8000/v1), or delete "
            f"regenerate.{name}",
        )
        for name in ("model", "request_timeout_s")
    ]


def test_an_unusable_output_is_an_error_only_when_files_are_looked_at(tmp_path: Path) -> None:
    section = RegenerateSection()
    output = tmp_path / "adir"
    output.mkdir()
    found = check_regenerate(
        section, training_seq_len=512, output=output, source=None, resolve=True
    )
    assert [attrs.astuple(f) for f in found] == [
        (
            "regenerate-output-unusable",
            Severity.ERROR,
            "regenerate.output_path",
            f"the output {output} is a directory",
            "set regenerate.output_path (or --output) to a new .jsonl file",
        )
    ]
    assert (
        check_regenerate(section, training_seq_len=512, output=output, source=None, resolve=False)
        == []
    )


# ---------------------------------------------------------------------------------------------
# target_server
# ---------------------------------------------------------------------------------------------


def _served(recipe: Recipe, **fields: object) -> Recipe:
    values: dict[str, object] = {"urls": ("http://localhost:8000",), "storage_dir": "hs", **fields}
    return attrs.evolve(recipe, target_server=TargetServerSection(**values))  # type: ignore[arg-type]


@pytest.fixture
def short_recipe(make_recipe: RecipeFactory, tmp_path: Path) -> Recipe:
    """The tiny recipe at a length vLLM serves (the target's max_position_embeddings is 4096),
    with `tmp_path/hs` as the storage folder."""
    (tmp_path / "hs").mkdir()
    return make_recipe(training={"training_seq_len": 128})


def test_the_plan_records_the_served_target_with_every_default(
    tmp_path: Path, short_recipe: Recipe
) -> None:
    result = compile_in(tmp_path, _served(short_recipe))
    assert result.plan is not None and result.plan.target_server is not None
    server = result.plan.target_server
    assert server.urls == ("http://localhost:8000",)
    assert server.storage_dir == str(tmp_path / "hs")  # relative to the recipe's folder
    assert server.served_model_name == "base"  # the base model folder's name
    assert (server.max_in_flight, server.timeout_s, server.retries) == (8, 120.0, 3)
    assert (server.backoff_s, server.lock_timeout_s) == (2.0, 30.0)
    assert (server.keep_files, server.capture_dir, server.api_key_env) == ("delete", None, None)
    # taps (1, 5) of the 8-layer target, no teacher: ids 2 and 6
    assert result.plan.draft.target_layer_ids == (1, 5)
    assert (server.vllm_layer_ids, server.tap_rows, server.final_row) == ((2, 6), (0, 1), None)
    assert (server.dtype, server.max_model_len) == ("bfloat16", 129)
    assert type(result.plan).from_json(result.plan.to_json()) == result.plan
    assert not [d for d in result.diagnostics if d.path.startswith("target_server")]


def test_a_teacher_objective_adds_the_last_layer_before_the_norm(
    tmp_path: Path, short_recipe: Recipe
) -> None:
    teacher = attrs.evolve(
        short_recipe,
        dflash=attrs.evolve(short_recipe.dflash, dflash_self_logit_distillation=True),
        model=attrs.evolve(short_recipe.model, dtype="float32"),
    )
    result = compile_in(tmp_path, _served(teacher, served_model_name="tiny"))
    assert result.plan is not None and result.plan.target_server is not None
    server = result.plan.target_server
    assert (server.vllm_layer_ids, server.tap_rows, server.final_row) == ((2, 6, 8), (0, 1), 2)
    assert (server.dtype, server.served_model_name) == ("float32", "tiny")


def test_keeping_the_files_keeps_them_in_the_run_directory_unless_told_otherwise(
    tmp_path: Path, short_recipe: Recipe
) -> None:
    result = compile_in(tmp_path, _served(short_recipe, keep_files="capture"))
    assert result.plan is not None and result.plan.target_server is not None
    output = Path(result.plan.training.output_dir)
    assert result.plan.target_server.capture_dir == str(output / "target-states")
    chosen = compile_in(tmp_path, _served(short_recipe, keep_files="capture", capture_dir="kept"))
    assert chosen.plan is not None and chosen.plan.target_server is not None
    assert chosen.plan.target_server.capture_dir == str(tmp_path / "kept")


def test_a_capture_dir_that_nothing_is_kept_in_warns(tmp_path: Path, short_recipe: Recipe) -> None:
    result = compile_in(tmp_path, _served(short_recipe, capture_dir="kept"))
    found = only(result, "target-server-field-unused")
    assert found.severity is Severity.WARNING and found.path == "target_server.capture_dir"
    assert "keep_files is delete" in found.message
    assert result.plan is not None and result.plan.target_server is not None
    assert result.plan.target_server.capture_dir is None


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("localhost:8000", "must start with http:// or https://"),
        ("http://localhost:8000/v1/completions", "names an endpoint"),
        ("http://me:secret@localhost:8001", "carries credentials"),
    ],
)
def test_a_bad_server_url_is_an_error_at_its_entry_at_schema_level(
    tmp_path: Path, short_recipe: Recipe, url: str, why: str
) -> None:
    recipe = _served(short_recipe, urls=("http://gpu0:8000", url))
    result = _compile(tmp_path, recipe, resolve=False)
    assert result.plan is None
    found = _only(result, "target-server-bad-url")
    assert found.path == "target_server.urls.1"
    assert f"target_server.urls[1] {url!r} {why}" in found.message
    assert found.hint is not None and "http://localhost:8000" in found.hint


def test_one_server_named_twice_is_an_error_at_the_second_entry(
    tmp_path: Path, short_recipe: Recipe
) -> None:
    urls = ("http://gpu0:8000", "http://gpu1:8000", "http://GPU0:8000/v1/")
    result = _compile(tmp_path, _served(short_recipe, urls=urls), resolve=False)
    found = _only(result, "target-server-duplicate-url")
    assert found.path == "target_server.urls.2"
    assert "is the server of target_server.urls[0] (http://gpu0:8000) again" in found.message
    replicas = ("http://gpu0:8000", "http://gpu0:8001")
    assert _compile(tmp_path, _served(short_recipe, urls=replicas)).plan is not None


def test_a_served_target_with_offline_data_is_an_error(
    tmp_path: Path, short_recipe: Recipe
) -> None:
    offline = attrs.evolve(
        short_recipe, data=attrs.evolve(short_recipe.data, hidden_states_path="capture")
    )
    result = _compile(tmp_path, _served(offline), resolve=False)
    found = _only(result, "target-server-offline")
    assert found.path == "target_server"
    assert "data.hidden_states_path" in found.message
    assert found.hint is not None and "delete data.hidden_states_path" in found.hint


def test_the_storage_folder_must_exist_be_a_folder_and_be_writable(
    tmp_path: Path, short_recipe: Recipe
) -> None:
    found = _only(
        _compile(tmp_path, _served(short_recipe, storage_dir="absent")),
        TARGET_SERVER_STORAGE_MISSING,
    )
    assert found.path == "target_server.storage_dir"
    assert f"{tmp_path / 'absent'} does not exist" in found.message
    assert found.hint is not None and f"mkdir -p {tmp_path / 'absent'}" in found.hint
    assert _compile(tmp_path, _served(short_recipe, storage_dir="absent"), resolve=False).ok

    (tmp_path / "afile").write_text("x")
    found = _only(
        _compile(tmp_path, _served(short_recipe, storage_dir="afile")),
        "target-server-storage-unusable",
    )
    assert "is a file, not a folder" in found.message
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "locked").mkdir(mode=0o500)
        found = _only(
            _compile(tmp_path, _served(short_recipe, storage_dir="locked")),
            "target-server-storage-unusable",
        )
        assert "not readable and writable by this user" in found.message


def test_a_length_vllm_would_refuse_is_an_error(tmp_path: Path, make_recipe: RecipeFactory) -> None:
    (tmp_path / "hs").mkdir()
    at_limit = make_recipe(training={"training_seq_len": 4096})  # max_position_embeddings 4096
    found = _only(_compile(tmp_path, _served(at_limit)), "target-server-max-model-len")
    assert found.path == "training.training_seq_len"
    assert "--max-model-len 4097" in found.message and "4096" in found.message
    assert found.hint == "set training.training_seq_len: 4095 or less"
    below = make_recipe(training={"training_seq_len": 4095})
    result = _compile(tmp_path, _served(below))
    assert result.plan is not None and result.plan.target_server is not None
    assert result.plan.target_server.max_model_len == 4096
    # the in-process target has no such limit
    assert _compile(tmp_path, at_limit).plan is not None


def test_an_api_key_variable_that_is_unset_warns(
    tmp_path: Path, short_recipe: Recipe, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DFLASH_TEST_VLLM_KEY", raising=False)
    recipe = _served(short_recipe, api_key_env="DFLASH_TEST_VLLM_KEY")
    found = _only(_compile(tmp_path, recipe), "target-server-api-key-unset")
    assert found.path == "target_server.api_key_env"
    assert "names DFLASH_TEST_VLLM_KEY, which is not set" in found.message
    monkeypatch.setenv("DFLASH_TEST_VLLM_KEY", "secret")
    result = _compile(tmp_path, recipe)
    assert result.plan is not None and result.plan.target_server is not None
    assert result.plan.target_server.api_key_env == "DFLASH_TEST_VLLM_KEY"
    assert "secret" not in result.plan.to_json()


def test_the_section_from_yaml_is_located_and_overrides_can_make_it(
    tmp_path: Path,
    write_recipe: Callable[..., Path],
    recipe_text: Callable[..., str],
    train_file: Path,
    base_model: Path,
) -> None:
    (tmp_path / "hs").mkdir()
    section = (
        "training:\n  training_seq_len: 128\n"
        "target_server:\n"
        "  urls:\n"
        "    - http://gpu0:8000\n"
        "    - gpu1:8000\n"
        "  storage_dir: hs\n"
    )
    path = write_recipe(recipe_text() + section)
    result = compile_file(path, resolve=False)
    found = _only(result, "target-server-bad-url")
    line = (recipe_text() + section).splitlines().index("    - gpu1:8000") + 1
    assert (found.file, found.line) == (str(path), line)

    plain = write_recipe(recipe_text() + "training:\n  training_seq_len: 128\n", name="p.yaml")
    made = compile_file(
        plain, ["target_server.urls=[http://gpu0:8000]", "target_server.storage_dir=hs"]
    )
    assert made.plan is not None and made.plan.target_server is not None
    assert made.plan.target_server.storage_dir == str(tmp_path / "hs")
    half = compile_file(plain, ["target_server.urls=[http://gpu0:8000]"], resolve=False)
    assert half.plan is None
    missing = [d for d in half.diagnostics if d.code == "missing-field"]
    assert [d.path for d in missing] == ["target_server.storage_dir"]
    empty = compile_file(plain, ["target_server.urls=[]", "target_server.storage_dir=hs"])
    bad = [d for d in empty.diagnostics if d.code == "invalid-value"]
    assert [d.path for d in bad] == ["target_server.urls"]
    assert "non-empty list of server URLs" in bad[0].message
    keep = compile_file(
        plain,
        [
            "target_server.urls=[http://a:1]",
            "target_server.storage_dir=hs",
            "target_server.keep_files=move",
        ],
        resolve=False,
    )
    assert any("delete, capture" in d.message for d in keep.diagnostics)


def test_the_target_server_findings_read_word_for_word(tmp_path: Path) -> None:
    from dflash_recipes.checkpoint.target_facts import RopePlan, TargetFacts

    facts = TargetFacts(
        model_type="qwen3",
        architectures=("Qwen3ForCausalLM",),
        hidden_size=32,
        num_hidden_layers=8,
        vocab_size=256,
        max_position_embeddings=512,
        rope=RopePlan(rope_theta=1e6),
    )
    section = TargetServerSection(urls=("http://h:1", "http://h:1/v1"), storage_dir="x")
    found = check_target_server(
        section,
        hidden_states_path="cap",
        storage_dir=tmp_path / "x",
        capture_dir_set=False,
        training_seq_len=512,
        facts=facts,
        resolve=True,
    )
    assert [attrs.astuple(f) for f in found] == [
        (
            "target-server-duplicate-url",
            Severity.ERROR,
            "target_server.urls.1",
            "target_server.urls[1] 'http://h:1/v1' is the server of target_server.urls[0] "
            "(http://h:1) again; each replica would be asked twice as often and count as two",
            "delete target_server.urls[1], or give the replica's own host:port",
        ),
        (
            "target-server-offline",
            Severity.ERROR,
            "target_server",
            "target_server is set and so is data.hidden_states_path: a run from a capture reads "
            "the target's states from its shards and never asks a server",
            "delete data.hidden_states_path to train online through the server, or delete the "
            "target_server section to train offline from the capture",
        ),
        (
            "target-server-max-model-len",
            Severity.ERROR,
            "training.training_seq_len",
            "the served target needs --max-model-len 513 (training.training_seq_len 512 plus the "
            "one token the server generates), above the target's max_position_embeddings 512: "
            "vLLM refuses to start with it",
            "set training.training_seq_len: 511 or less",
        ),
        (
            "target-server-storage-missing",
            Severity.ERROR,
            "target_server.storage_dir",
            f"target_server.storage_dir {tmp_path / 'x'} does not exist",
            f"create it with `mkdir -p {tmp_path / 'x'}`: the folder vLLM writes into, as the "
            "trainer sees it (the same path on the servers: /dev/shm/... on one node, a shared "
            "file system across nodes)",
        ),
    ]
    scaled = attrs.evolve(facts, rope=RopePlan(rope_theta=1e6, rope_type="yarn"))
    found = check_target_server(
        TargetServerSection(urls=("http://h:1",), storage_dir="x"),
        hidden_states_path=None,
        storage_dir=tmp_path,
        capture_dir_set=False,
        training_seq_len=512,
        facts=scaled,  # vLLM derives a longer limit from a scaled RoPE
        resolve=True,
    )
    assert found == []
