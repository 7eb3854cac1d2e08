"""Compiling against an edited checkpoint config.json, and the fields the code reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dflash_recipes.checkpoint.config_fields import CHECKPOINT_FIELDS
from dflash_recipes.checkpoint.hfconfig import checkpoint_config_from_mapping
from dflash_recipes.compiler.compilation import CompileResult, compile_recipe
from dflash_recipes.compiler.field_checks import check_checkpoint_fields
from dflash_recipes.diagnostics import registered_codes
from testkit.compiling import RecipeFactory
from testkit.st_fixtures import drafter_config, write_drafter_checkpoint

REGISTERED = {info.code: info.severity for info in registered_codes()}


def compile_with_config(
    tmp_path: Path,
    make_recipe: RecipeFactory,
    edit: Callable[[dict[str, Any]], None],
    *,
    tensors: Mapping[str, Any] | None = None,
    **recipe: Any,
) -> CompileResult:
    """Compile the tiny warm start after `edit` changed the drafter's config.json.

    `tensors`: what `write_drafter_checkpoint` writes beyond the backbone (a head's sizes).
    """
    config = drafter_config()
    edit(config)
    write_drafter_checkpoint(tmp_path / "drafter", config=config, **(tensors or {}))
    result = compile_recipe(make_recipe(**recipe), base_dir=tmp_path)
    for d in result.diagnostics:
        assert REGISTERED.get(d.code) is d.severity, d
        assert d.path and d.message and d.hint, d
    return result


def nested(config: dict[str, Any]) -> dict[str, Any]:
    section: dict[str, Any] = config["dflash_config"]
    return section


class _Recording(dict[str, Any]):
    """A config section that records every key the code looks up (get, [], in)."""

    def __init__(self, data: Mapping[str, Any], prefix: str, seen: set[str]) -> None:
        super().__init__(
            {
                k: _Recording(v, "dflash_config.", seen) if k == "dflash_config" else v
                for k, v in data.items()
            }
        )
        self.prefix = prefix
        self.seen = seen

    def get(self, key: Any, default: Any = None) -> Any:
        self.seen.add(self.prefix + key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.seen.add(self.prefix + key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.seen.add(self.prefix + key)
        return super().__contains__(key)

    def __iter__(self) -> Iterator[str]:
        return super().__iter__()


def _keys_the_code_reads(config: Mapping[str, Any]) -> set[str]:
    seen: set[str] = set()
    recording = _Recording(config, "", seen)
    checkpoint_config_from_mapping(recording, "config.json")
    for projector in ("dflash", "domino", "dspark"):
        check_checkpoint_fields(
            recording, {}, where="config.json", training_seq_len=4096, projector_type=projector
        )
    return seen


def _every_known_field() -> dict[str, Any]:
    """A config.json with every inventory field set (benign values)."""
    config: dict[str, Any] = drafter_config()
    section = nested(config)
    for field in CHECKPOINT_FIELDS:
        top, _, inner = field.key.partition(".")
        if inner:
            section.setdefault(inner, 1)
        else:
            config.setdefault(top, 1)
    return config
