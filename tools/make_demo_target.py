"""Rebuild the embedded tiny default shipped in `dflash_recipes/demo_data/`.

    python tools/make_demo_target.py            # writes dflash_recipes/demo_data/

Deterministic: an invented "atlas" rendered into chat conversations, a byte-level BPE
tokenizer trained on it, and a 6-layer, width-128 Qwen3 target pretrained on it (about a
minute or two on 2 CPU cores). The result is committed so the demo and the tests need
neither the network nor this pretraining time.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import torch

from dflash_recipes.executor.demo.assets import build_demo_assets

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "dflash_recipes" / "demo_data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    if args.out.exists():
        shutil.rmtree(args.out)
    assets = build_demo_assets(args.out, pretrain_steps=args.steps, force=True)
    for path in sorted(assets.root.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size:>10}  {path}")


if __name__ == "__main__":
    main()
