"""The oldest torch and transformers the executor runs on, checked when it is imported.

The floors are the ones ``pyproject.toml`` declares (a test keeps the two equal), and each has
its reason in the code:

- torch 2.10: the launcher of ``--nproc-per-node`` needs torchrun's ``--signals-to-handle``,
  which keeps the stop grace where ``--shutdown-timeout`` (2.12) is missing and came with
  2.10; torch 2.9's torchrun has neither, so the launcher could not work on it
  (:mod:`dflash_recipes.executor.launch`) and 2.9 is refused here. The rest needs 2.9: flex
  attention's ``AuxRequest`` (``return_aux=AuxRequest(lse=True)``, the drafter's attention
  with a sink); FSDP2's ``fully_shard`` (2.6).
- transformers 5.17 (the release the December 2026 GPU image ships): the RoPE settings as
  ``rope_parameters`` and the Qwen3/Llama classes of transformers 5, the hidden-state
  recording registry a ``fully_shard``-ed target keeps (``transformers.utils.output_capturing``,
  5.2); 5.0 and 5.2 fail the warm-start and export tests (the museglimmer layout and DSpark
  heads do not load bit-exactly), and no release between 5.2 and 5.17 was tried.

The CI's floor leg (``.ci/run``) runs the model, export, distributed, launcher and evaluation
tests on these transformers and pure-Python floors. Versions are read from the installed
distributions' metadata, without importing either library (``regenerate`` against a server
imports neither). Only the release numbers count: ``2.10.0a0+git...`` (a container's build of
the 2.10 branch) is 2.10.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from dflash_recipes.errors import LaunchError

#: The oldest release of each library the executor runs on (pyproject.toml says the same).
REQUIRED: dict[str, tuple[int, ...]] = {"torch": (2, 10), "transformers": (5, 17)}

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def release(text: str) -> tuple[int, ...] | None:
    """The release numbers at the start of a version string (``2.11.0+cu130`` -> (2, 11, 0))."""
    match = _RELEASE.match(text)
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution`, None when it is not installed."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _dotted(numbers: tuple[int, ...]) -> str:
    return ".".join(str(n) for n in numbers)


def check_versions(installed: Callable[[str], str | None] = installed_version) -> None:
    """Raise LaunchError, in one line naming both versions, when a library is too old.

    A library that is not installed, or whose version does not parse, is left to its import.
    """
    old = []
    for name, required in REQUIRED.items():
        found = installed(name)
        numbers = release(found) if found is not None else None
        if found is not None and numbers is not None and numbers < required:
            old.append((name, found, _dotted(required)))
    if not old:
        return
    have = ", ".join(f"{name} {found}" for name, found, _ in old)
    need = ", ".join(f"{name} >= {required}" for name, _, required in old)
    pins = " ".join(f"'{name}>={required}'" for name, _, required in old)
    msg = (
        f"{have} installed, but dflash-recipes needs {need}: upgrade "
        f"(pip install {pins}), or install dflash-recipes into an environment that has them"
    )
    raise LaunchError(msg)


__all__ = ["REQUIRED", "check_versions", "installed_version", "release"]
