"""Rebuild the embedded tiny default shipped in `dflash_recipes/demo_data/`.

    python tools/make_demo_target.py               # writes dflash_recipes/demo_data/
    python tools/make_demo_target.py --data-only   # rewrites its data/*.jsonl only (seconds)
    python tools/make_demo_target.py --check       # exit 1 if data/*.jsonl differ from the code

Deterministic: an invented "atlas" rendered into chat conversations, a byte-level BPE
tokenizer trained on it, and a 6-layer, width-128 Qwen3 target pretrained on it (about a
minute or two on 2 CPU cores). The result is committed so the demo and the tests need
neither the network nor this pretraining time. The data files depend on the atlas alone, not
on the target: `--data-only` rewrites them without pretraining again, and `--check` compares
the committed ones with what `executor/demo/assets.py` generates (the eval set asks only about
cities no training file mentions).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

import torch

from dflash_recipes.executor.demo.assets import (
    build_demo_assets,
    data_file_text,
    demo_conversations,
    write_demo_data,
)

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "dflash_recipes" / "demo_data"
#: What a rebuild replaces; `recipes` (a link to recipes/tiny) and anything else stay.
_BUILT = ("target", "data", "assets.json")


def stale_data_files(out: Path) -> list[str]:
    """The data files under `out/data` whose text is not what the code generates."""
    stale = []
    for name, rows in demo_conversations().items():
        path = out / "data" / name
        if not path.is_file() or path.read_text(encoding="utf-8") != data_file_text(rows):
            stale.append(str(path))
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=400)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--data-only", action="store_true", help="rewrite data/*.jsonl only")
    mode.add_argument("--check", action="store_true", help="exit 1 if data/*.jsonl are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_data_files(args.out)
        for path in stale:
            print(
                f"{path} is not what executor/demo/assets.py generates; rewrite it with: "
                "python tools/make_demo_target.py --data-only",
                file=sys.stderr,
            )
        return 1 if stale else 0
    if args.data_only:
        for path in write_demo_data(args.out / "data"):
            print(f"{path.stat().st_size:>10}  {path}")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    for name in _BUILT:
        path = args.out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    assets = build_demo_assets(args.out, pretrain_steps=args.steps, force=True)
    for path in sorted(assets.root.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size:>10}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
