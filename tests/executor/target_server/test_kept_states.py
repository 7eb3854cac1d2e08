"""The states a run keeps (target_server.keep_files: capture): read back checked instead of asked
again, keyed so another plan never reads them, and nothing half-kept left behind."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from testkit.vllm_server import SavedTarget, ServerPair, SettingsFactory

from dflash_recipes.errors import TargetServerUnavailable
from dflash_recipes.executor.target_server.client import TargetServerClient
from dflash_recipes.executor.target_server.kept_states import (
    DESCRIPTION_FILE,
    KeptStates,
    ServedConversations,
    ids_sha256,
    kept_folder,
)
from dflash_recipes.executor.target_server.states_file import ExpectedStates

from .conftest import HIDDEN, LAYER_IDS

CONVERSATIONS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def _expected() -> ExpectedStates:
    return ExpectedStates(LAYER_IDS, HIDDEN, "float32")


def _kept(root: Path, target: SavedTarget, **changes: object) -> KeptStates:
    expected = _expected()
    if changes:
        expected = ExpectedStates(
            tuple(changes.get("layer_ids", expected.layer_ids)),  # type: ignore[arg-type]
            expected.hidden_size,
            str(changes.get("dtype", expected.dtype)),
        )
    folder = kept_folder(
        root,
        base_model=target.path,
        served_model_name=str(changes.get("name", "tiny")),
        expected=expected,
    )
    return KeptStates(folder, expected)


def test_answers_are_kept_by_their_token_ids_and_read_back_without_a_request(
    tmp_path: Path, servers: ServerPair, settings: SettingsFactory, target: SavedTarget
) -> None:
    kept = _kept(tmp_path / "kept", target)
    with TargetServerClient(settings(keep_dir=kept.folder)) as client:
        conversations = ServedConversations(client, kept)
        first = conversations(CONVERSATIONS)
        assert servers.first.stats()["answered"] == 2
        again = conversations(CONVERSATIONS, [7, 8])
    assert servers.first.stats()["answered"] == 2  # the second call asked nothing
    assert (conversations.asked, conversations.read_back) == (2, 2)
    names = sorted(p.name for p in kept.folder.glob("*.safetensors"))
    assert names == sorted(f"{ids_sha256(ids)}.safetensors" for ids in CONVERSATIONS)
    for one, two in zip(first, again, strict=True):
        assert torch.equal(one.hidden_states, two.hidden_states)
        assert torch.equal(one.token_ids, two.token_ids)
    assert again[0].server.startswith("kept states")
    assert not list(servers.storage.glob("*.safetensors"))  # moved out of vLLM's folder


def test_kept_states_answer_when_no_server_does(
    tmp_path: Path, servers: ServerPair, settings: SettingsFactory, target: SavedTarget
) -> None:
    kept = _kept(tmp_path / "kept", target)
    with TargetServerClient(settings(keep_dir=kept.folder)) as client:
        ServedConversations(client, kept)(CONVERSATIONS[:1])
    servers.first.control(fail_500=10**6)
    with TargetServerClient(settings(keep_dir=kept.folder, retries=0)) as client:
        conversations = ServedConversations(client, kept)
        assert len(conversations(CONVERSATIONS[:1])) == 1
        with pytest.raises(TargetServerUnavailable):  # not kept: the servers are asked
            conversations(CONVERSATIONS[1:])


def test_a_kept_file_that_fails_its_checks_is_deleted_and_asked_again(
    tmp_path: Path,
    servers: ServerPair,
    settings: SettingsFactory,
    target: SavedTarget,
    caplog: pytest.LogCaptureFixture,
) -> None:
    kept = _kept(tmp_path / "kept", target)
    ids = CONVERSATIONS[0]
    states = torch.randn(len(ids), len(LAYER_IDS), HIDDEN)
    states[2, 1, 0] = float("nan")
    save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(kept.path(ids)))
    with (
        caplog.at_level(logging.WARNING),
        TargetServerClient(settings(keep_dir=kept.folder)) as client,
    ):
        conversations = ServedConversations(client, kept)
        (answer,) = conversations([ids])
    assert "failed its checks" in caplog.text and "NaN" in caplog.text
    assert conversations.asked == 1 and servers.first.stats()["answered"] == 1
    assert torch.isfinite(answer.hidden_states).all()
    assert answer.path == kept.path(ids) and kept.path(ids).is_file()  # the fresh answer, kept

    kept.path(ids).write_bytes(b"\x08\x00\x00")  # a truncated file: unreadable
    assert kept.find(ids, conversation=0) is None
    assert not kept.path(ids).exists()


def test_another_target_or_other_taps_never_read_these_states(
    tmp_path: Path, target: SavedTarget
) -> None:
    root = tmp_path / "kept"
    folders = {
        _kept(root, target).folder,
        _kept(root, target, layer_ids=(0, 2)).folder,
        _kept(root, target, dtype="bfloat16").folder,
        _kept(root, target, name="other").folder,
    }
    assert len(folders) == 4
    assert _kept(root, target).folder in folders  # the same plan finds its folder again
    assert all((folder / DESCRIPTION_FILE).is_file() for folder in folders)


def test_a_file_moved_in_but_never_named_is_deleted_when_the_folder_opens(
    tmp_path: Path, target: SavedTarget
) -> None:
    kept = _kept(tmp_path / "kept", target)
    stale = kept.folder / "cmpl-abc-0-12345678.safetensors"
    stale.write_bytes(b"half")
    named = kept.path(CONVERSATIONS[0])
    named.write_bytes(b"x")
    reopened = KeptStates(kept.folder, _expected())
    assert not stale.exists() and named.exists()
    assert len(reopened) == 1
