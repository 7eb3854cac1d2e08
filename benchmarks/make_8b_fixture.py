"""Write a Qwen3-8B-scale warm-start fixture without real weights, for benchmarks.

    python benchmarks/make_8b_fixture.py OUT_DIR

What it writes is described in tests/testkit/fixture_8b.py (shared with the tests and
bench_compile_8b.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _measure  # noqa: F401 (puts tests/ on sys.path for testkit)
from testkit.fixture_8b import make_fixture


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out_dir", type=Path, help="folder to write the fixture into")
    args = parser.parse_args(argv)
    for line in make_fixture(args.out_dir):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
