"""What checking a capture's shard hashes costs: sha256 of a shard against reading it.

Writes one 256 MiB shard-sized file, then, round by round (interleaved, medians): reads it in
1 MiB chunks (the baseline: the bytes training reads anyway), and hashes it with
:func:`~dflash_recipes.files.capture_manifest.file_sha256` (what a shard's first use, `run
--verify-capture` and a capture's completion do). Both read from the page cache, so the ratio
is the hash's own CPU cost. Also times :func:`samples_sha256` over the token ids and masks a 10 GB
capture at the Qwen3-8B shape holds. Prints the figures extrapolated to a 10 GB capture.

    python benchmarks/bench_capture_verify.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from dflash_recipes.files.capture_manifest import bytes_per_token, file_sha256, samples_sha256

SIZE = 256 * 2**20
ROUNDS = 5
CAPTURE_BYTES = 10 * 10**9


def _read(path: Path) -> None:
    with path.open("rb") as handle:
        while handle.read(2**20):
            pass


def _timed(fn: object, *args: object) -> float:
    start = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "shard-00000.safetensors"
        block = os.urandom(2**20)
        with path.open("wb") as handle:
            for _ in range(SIZE // len(block)):
                handle.write(block)
        _read(path)  # warm the page cache
        reads, hashes = [], []
        for _ in range(ROUNDS):
            reads.append(_timed(_read, path))
            hashes.append(_timed(file_sha256, path))
    read_s, hash_s = statistics.median(reads), statistics.median(hashes)
    # Qwen3-8B: 5 taps of hidden size 4096 in bfloat16 (no teacher state).
    per_token = bytes_per_token(5, 4096, "bfloat16", last_hidden=False)
    tokens = CAPTURE_BYTES // per_token
    ids = [(list(range(i, i + 2048)), [1] * 2048) for i in range(0, tokens, 2048)]
    token_s = _timed(samples_sha256, ids)
    scale = CAPTURE_BYTES / SIZE
    print(f"read from page cache : {SIZE / read_s / 2**30:6.2f} GiB/s")
    print(f"sha256 (file_sha256) : {SIZE / hash_s / 2**30:6.2f} GiB/s")
    print(f"hash / read time     : {hash_s / read_s:6.2f}x")
    print(
        f"10 GB capture        : sha256 of every shard {hash_s * scale:5.1f} s "
        f"(reading it from cache: {read_s * scale:5.1f} s)"
    )
    print(
        f"sample hashes       : {token_s:6.3f} s for the {tokens} tokens of a 10 GB capture at "
        f"the Qwen3-8B shape ({per_token} bytes a token)"
    )


if __name__ == "__main__":
    main()
