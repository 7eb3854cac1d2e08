"""The served states a run keeps (``target_server.keep_files: capture``), read again instead of
asking the servers: later epochs, a resume and a rerun train from them offline.

Each conversation the servers answered is kept as the file vLLM wrote (``token_ids`` and
``hidden_states``, every check passed), renamed after the sha256 of its token ids, in a folder of
``capture_dir`` whose name is a key of everything that decides the states: the base model's
``config.json``, the served model name, the vLLM layer ids, the hidden size and the dtype
(``states-<16 hex>``, described in its ``kept-states.json``). A plan with other taps or another
target therefore never reads them. Before a kept file is used it passes the checks a fresh
answer passes (:func:`~dflash_recipes.executor.target_server.states_file.read_states_file`:
its tensors, layer count, hidden size, dtype, the token ids equal to the conversation's, no
NaN/Inf); a kept file that fails them is deleted with a warning and the conversation asked of
the servers again.

A file moved in from the servers' folder but not renamed yet (a run killed in between) is
deleted when the folder is next opened; renames are atomic, so a reader sees a whole kept file or
none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import attrs

from dflash_recipes.errors import RunIOError, ServedStatesError
from dflash_recipes.executor.target_server.client import TargetServerClient
from dflash_recipes.executor.target_server.states_file import (
    ExpectedStates,
    ServedStates,
    StatesFileFailure,
    read_states_file,
)
from dflash_recipes.files.capture_manifest import base_config_sha256
from dflash_recipes.files.crashsafe import write_text_atomic

logger = logging.getLogger(__name__)

#: The file describing a folder of kept states (what its key was made of).
DESCRIPTION_FILE = "kept-states.json"
_SUFFIX = ".safetensors"


def ids_sha256(token_ids: Sequence[int]) -> str:
    """The name of a conversation's kept file: sha256 of its token ids (int64, little-endian)."""
    ids = list(token_ids)
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


def kept_folder(
    capture_dir: Path, *, base_model: Path, served_model_name: str, expected: ExpectedStates
) -> Path:
    """The folder of `capture_dir` that keeps the states of this target, served this way."""
    facts = {
        "base_config_sha256": base_config_sha256(base_model),
        "served_model_name": served_model_name,
        "vllm_layer_ids": list(expected.layer_ids),
        "hidden_size": expected.hidden_size,
        "dtype": expected.dtype,
    }
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    folder = capture_dir / f"states-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    description = folder / DESCRIPTION_FILE
    if not description.is_file():
        write_text_atomic(description, json.dumps(facts, indent=2, sort_keys=True) + "\n")
    return folder


class KeptStates:
    """A folder of kept states (see the module docstring): :meth:`find` reads one back, checked;
    :meth:`keep` names a file the servers' client moved in."""

    def __init__(self, folder: Path, expected: ExpectedStates) -> None:
        self.folder = folder
        self.expected = expected
        for stale in folder.glob(f"cmpl-*{_SUFFIX}"):  # moved in, never renamed
            stale.unlink(missing_ok=True)

    def __len__(self) -> int:
        return sum(1 for _ in self.folder.glob(f"*{_SUFFIX}"))

    def path(self, token_ids: Sequence[int]) -> Path:
        return self.folder / f"{ids_sha256(token_ids)}{_SUFFIX}"

    def find(self, token_ids: Sequence[int], *, conversation: int) -> ServedStates | None:
        """The kept states of `token_ids`, every check passed; None when none are kept (or the
        kept file failed a check: it is deleted, with a warning)."""
        path = self.path(token_ids)
        if not path.is_file():
            return None
        where = f"kept states {self.folder}"
        try:
            states, ids = read_states_file(
                path, token_ids, expected=self.expected, server=where, conversation=conversation
            )
        except (StatesFileFailure, ServedStatesError) as exc:
            logger.warning("deleted a kept file that failed its checks; asking again: %s", exc)
            path.unlink(missing_ok=True)
            return None
        return ServedStates(states, ids, where, path)

    def keep(self, answer: ServedStates) -> ServedStates:
        """`answer` with its file (moved into this folder by the client) renamed after its token
        ids; RunIOError when it cannot be."""
        if answer.path is None:
            msg = f"the answer of {answer.server} has no kept file to name (keep_dir unset)"
            raise RunIOError(msg)
        target = self.path(answer.token_ids.tolist())
        try:
            os.replace(answer.path, target)
        except OSError as exc:
            answer.path.unlink(missing_ok=True)
            msg = f"cannot keep the file {answer.path} from {answer.server} as {target}: {exc}"
            raise RunIOError(msg) from exc
        return attrs.evolve(answer, path=target)


class ServedConversations:
    """Whole conversations' states: the kept ones read back (no request), the others asked of
    the servers in one batch and kept (when `kept` is given)."""

    def __init__(self, client: TargetServerClient, kept: KeptStates | None) -> None:
        self.client = client
        self.kept = kept
        #: Conversations read back from the kept states, and asked of the servers, so far.
        self.read_back = self.asked = 0

    def __call__(
        self, conversations: Sequence[Sequence[int]], names: Sequence[int] | None = None
    ) -> list[ServedStates]:
        named = list(names) if names is not None else list(range(len(conversations)))
        found: list[ServedStates | None] = [None] * len(conversations)
        if self.kept is not None:
            found = [
                self.kept.find(ids, conversation=name)
                for ids, name in zip(conversations, named, strict=True)
            ]
        missing = [i for i, answer in enumerate(found) if answer is None]
        self.read_back += len(conversations) - len(missing)
        self.asked += len(missing)
        if missing:
            fresh = self.client.states(
                [conversations[i] for i in missing], indices=[named[i] for i in missing]
            )
            for i, answer in zip(missing, fresh, strict=True):
                found[i] = answer if self.kept is None else self.kept.keep(answer)
        return [answer for answer in found if answer is not None]


__all__ = ["KeptStates", "ServedConversations", "ids_sha256", "kept_folder"]
