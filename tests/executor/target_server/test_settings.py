"""The client's settings: URLs named host:port, vLLM's layer-id order, bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_recipes.errors import TargetServerError
from dflash_recipes.executor.target_server.settings import (
    TargetServerSettings,
    base_url,
    server_name,
)


def _settings(**overrides: object) -> TargetServerSettings:
    values: dict[str, object] = {
        "urls": ("http://127.0.0.1:8000",),
        "storage_dir": Path("/dev/shm/hs"),
        "served_model_name": "target",
        "layer_ids": (2, 10, 36),
        "hidden_size": 4096,
        "dtype": "bfloat16",
    }
    values.update(overrides)
    return TargetServerSettings(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "root", "name"),
    [
        ("http://node1:8000", "http://node1:8000", "node1:8000"),
        ("http://node1:8000/v1/", "http://node1:8000", "node1:8000"),
        ("http://node1:8000/v1/completions", "http://node1:8000", "node1:8000"),
        ("https://serve.example", "https://serve.example", "serve.example:443"),
        ("http://[::1]:9000", "http://[::1]:9000", "[::1]:9000"),
    ],
)
def test_a_server_is_its_root_and_named_host_port(url: str, root: str, name: str) -> None:
    assert base_url(url) == root
    assert server_name(url) == name


def test_the_defaults_and_the_doubling_backoff() -> None:
    settings = _settings(backoff_s=2.0)
    assert (settings.max_in_flight, settings.retries, settings.keep_dir) == (8, 3, None)
    assert [settings.backoff(n) for n in (1, 2, 3)] == [2.0, 4.0, 8.0]
    assert settings.server_names == ("127.0.0.1:8000",)
    assert "api_key" not in repr(_settings(api_key="secret"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"urls": ()}, "no URL"),
        ({"urls": ("node1:8000",)}, "is not http\\(s\\)://HOST:PORT"),
        ({"urls": ("http://a:1", "http://a:1/v1")}, "a server is named twice"),
        ({"layer_ids": (10, 2)}, "ascending and distinct"),
        ({"layer_ids": (2, 2)}, "ascending and distinct"),
        ({"layer_ids": ()}, "ascending and distinct"),
        ({"dtype": "fp8"}, "dtype 'fp8' must be one of"),
        ({"max_in_flight": 0}, "max_in_flight 0 must be at least 1"),
        ({"timeout_s": 0.0}, "timeout_s 0.0 must be above 0"),
        ({"retries": -1}, "retries -1 must be 0 or more"),
    ],
)
def test_settings_no_request_could_work_with_are_refused(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(TargetServerError, match=message):
        _settings(**overrides)
