"""The recipe's `regenerate:` section: validation, compile cross-checks (no network) and keys."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from dflash_recipes.compiler.compilation import CompileResult, compile_file, compile_recipe
from dflash_recipes.compiler.regenerate_checks import check_regenerate
from dflash_recipes.diagnostics import Diagnostic, Severity
from dflash_recipes.errors import RecipeError
from dflash_recipes.files.regenerate_output import prompt_key
from dflash_recipes.recipe.loader import load_recipe
from dflash_recipes.recipe.sections import Recipe, RegenerateSection

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
    assert any("keep, drop" in d.message for d in bad.diagnostics)


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
