"""Fixtures of the target_server tests: a tiny target saved to disk, two local servers that
answer as vLLM does (tests/testkit/vllm_server.py) sharing one storage folder, and settings."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.tiny import tiny_plan, tiny_target
from testkit.vllm_server import (
    SavedTarget,
    ServerPair,
    SettingsFactory,
    VllmServer,
    launch,
    wait_for_port,
)

from dflash_recipes.executor.target_server import TargetServerSettings

#: The vLLM ids the servers capture: the embeddings, decoder layer 1's output (DFlash tap 1)
#: and the last decoder layer's output before the final norm (id L of the 4-layer target).
LAYER_IDS = (0, 2, 4)
HIDDEN = 64


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> SavedTarget:
    plan = tiny_plan(tmp_path_factory.mktemp("target-server"))
    model = tiny_target(plan, save=True)
    return SavedTarget(model, Path(plan.base_model.path))


@pytest.fixture(scope="session")
def server_pair(
    tmp_path_factory: pytest.TempPathFactory, target: SavedTarget
) -> Iterator[ServerPair]:
    storage = tmp_path_factory.mktemp("shm")
    launched = [launch(target.path, storage, list(LAYER_IDS)) for _ in range(2)]
    started: list[VllmServer] = []
    try:
        started = [wait_for_port(one) for one in launched]
        yield ServerPair(started[0], started[1], storage)
    finally:
        for server in started:
            server.stop()
        for process, _ in launched:
            process.kill()
            process.wait()


def _settle(storage: Path) -> None:
    """Wait for the servers' pending writes (their default write delay), then empty the folder
    so one test's leftovers cannot pass or fail the next."""
    time.sleep(0.1)
    for path in storage.iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


@pytest.fixture
def servers(server_pair: ServerPair) -> Iterator[ServerPair]:
    for server in (server_pair.first, server_pair.second):
        server.reset()
    _settle(server_pair.storage)
    yield server_pair
    for server in (server_pair.first, server_pair.second):
        server.reset()
    _settle(server_pair.storage)


@pytest.fixture
def settings(servers: ServerPair) -> SettingsFactory:
    """Settings for the given servers (default: the first) with test-sized timeouts."""

    def make(*urls: str, **overrides: object) -> TargetServerSettings:
        values: dict[str, object] = {
            "urls": urls or (servers.first.url,),
            "storage_dir": servers.storage,
            "served_model_name": "tiny-target",
            "layer_ids": LAYER_IDS,
            "hidden_size": HIDDEN,
            "dtype": "float32",
            "max_in_flight": 4,
            "timeout_s": 5.0,
            "retries": 2,
            "backoff_s": 0.01,
            "lock_timeout_s": 5.0,
        }
        values.update(overrides)
        return TargetServerSettings(**values)  # type: ignore[arg-type]

    return make
