"""The `regenerate` rules `compile` and `regenerate` share: the base URL, its endpoints, the
output path, and the settings a plan carries."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash_recipes.plan.regenerate_settings import (
    base_url_problem,
    chat_completions_url,
    default_regenerate_plan,
    models_url,
    output_problem,
    regenerate_plan,
)
from dflash_recipes.recipe.sections import RegenerateSection


def test_endpoints_of_a_base_url() -> None:
    assert base_url_problem("http://10.0.0.5:30000/v1") is None
    assert chat_completions_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert models_url("https://api.example.com/v1") == "https://api.example.com/v1/models"


def test_an_output_that_is_the_input_itself_is_refused(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("{}\n")
    (tmp_path / "link.jsonl").symlink_to(prompts)
    message = (
        "the output {} is the input file itself; the prompts would be overwritten by their answers"
    )
    hint = "set regenerate.output_path (or --output) to a new .jsonl file"
    for output in (prompts, tmp_path / "link.jsonl"):
        assert output_problem(output, prompts) == (
            "regenerate-output-is-input",
            message.format(output),
            hint,
        )
    assert output_problem(tmp_path / "answers.jsonl", prompts) is None


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://h/v1", None),
        ("http://h:8000", None),
        ("//h/v1", "must start with http:// or https:// (scheme: none)"),
        ("https://", "has no host name"),
        ("http://h/v1?key=1", "must not carry a query (?...) or a fragment (#...)"),
        ("http://h/v1#top", "must not carry a query (?...) or a fragment (#...)"),
        (
            "http://h/v1/chat/completions/",
            "is the chat endpoint itself; give the base URL (ending in /v1)",
        ),
    ],
)
def test_each_base_url_reason_word_for_word(url: str, why: str | None) -> None:
    assert base_url_problem(url) == why


def test_an_upper_case_host_keeps_its_name_in_the_endpoints() -> None:
    assert chat_completions_url("http://GPU-BOX/") == "http://GPU-BOX/v1/chat/completions"


def test_the_output_folder_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hint = "set regenerate.output_path (or --output) to a new .jsonl file"
    output = tmp_path / "answers.jsonl"
    parts = tmp_path / "answers.jsonl.parts"
    parts.mkdir()  # the shards of an earlier run: resumed, not refused
    assert output_problem(output, None) is None
    parts.rmdir()
    parts.write_text("")
    assert output_problem(output, None) == (
        "regenerate-output-unusable",
        f"{parts} (where the output's shards go) is a file, not a folder",
        f"move {parts} away, or {hint}",
    )
    long = tmp_path / ("n" * 300 + ".jsonl")
    assert output_problem(long, None) == (
        "regenerate-output-unusable",
        f"the output {long} cannot be inspected: File name too long",
        hint,
    )
    access = os.access
    asked: list[int] = []

    def read_only(path: object, mode: int, **kwargs: object) -> bool:
        if path == tmp_path:
            asked.append(mode)
            return not mode & os.W_OK
        return access(path, mode, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", read_only)
    assert output_problem(tmp_path / "new.jsonl", None) == (
        "regenerate-output-unusable",
        f"the output's folder {tmp_path} is not writable by this user",
        f"make {tmp_path} writable, or {hint}",
    )
    assert asked == [os.W_OK | os.X_OK]


def test_the_plan_settings_of_a_section_and_of_none() -> None:
    section = RegenerateSection(api_key_env="SERVER_KEY", max_new_tokens=100)
    plan = regenerate_plan(section, None, training_seq_len=512)
    assert (plan.api_key_env, plan.max_new_tokens, plan.output_path) == ("SERVER_KEY", 100, None)
    default = default_regenerate_plan(256)
    assert default == regenerate_plan(RegenerateSection(), None, training_seq_len=256)
    assert (default.base_url, default.max_new_tokens, default.output_path) == (None, 256, None)
