"""torchrun (``torch.distributed.run``) as `run --nproc-per-node` starts it, minus its traceback
on a stop signal.

torchrun forwards SIGTERM / SIGINT to its workers, waits for them (they finish their step and
save, :mod:`dflash_recipes.executor.signals`), then raises ``SignalException`` out of its
``main`` and prints a traceback after the workers' one-line summary. Here that exception ends
the process with 128 + the signal number and nothing more; anything else is torchrun's own
behaviour, unchanged. Run as ``python -m dflash_recipes.executor.torchrun ARGS...`` with
torchrun's arguments.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main


def main() -> int:
    """torchrun's main; a stop signal it forwarded is exit 128 + signal, no traceback."""
    try:
        torchrun_main()
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
