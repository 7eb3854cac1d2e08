"""Tap states from a served target: vLLM with its hidden-states connector, over HTTP and a shared
folder, for targets bigger than the trainer (issue 50).

:class:`TargetServerClient` takes plain :class:`TargetServerSettings` (no plan): servers, the
shared folder, the vLLM layer ids it expects, the request policy. ``states(conversations)``
returns one :class:`ServedStates` per conversation (``[T, n_layers, H]`` and the token ids);
``prefetch(conversations)`` returns a :class:`Prefetch` at once, whose ``result()`` collects
them later, so the requests run while the trainer steps (``stream`` does it for a sequence of
batches). The names below are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_recipes.lazy import lazy_exports

if TYPE_CHECKING:
    from dflash_recipes.executor.target_server.client import Prefetch, TargetServerClient
    from dflash_recipes.executor.target_server.settings import TargetServerSettings, server_name
    from dflash_recipes.executor.target_server.states_file import ServedStates

_HOMES = {
    "Prefetch": "client",
    "TargetServerClient": "client",
    "TargetServerSettings": "settings",
    "server_name": "settings",
    "ServedStates": "states_file",
}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)

__all__ = [
    "Prefetch",
    "ServedStates",
    "TargetServerClient",
    "TargetServerSettings",
    "server_name",
]
