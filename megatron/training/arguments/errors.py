"""The one place where expected errors become one line on stderr and exit status 2.

Every entry point (pretrain_*.py, the tools) catches `EXPECTED_ERRORS` around its work and
returns `report_error(...)`: no traceback from our files reaches a user for a bad flag, a
missing or corrupt file or an unsupported combination. Anything else (a bug, a dead peer) keeps
its traceback. Under torchrun an error that every rank raises alike (before the process group
exists, or an `AgreedError`) is printed by rank 0 only; one that a single rank found is printed
by that rank, with its number. torchrun stops every rank as soon as one exits with an error, so
the other ranks hold such an agreed exit for a moment: rank 0 has printed before anyone exits.
"""

from __future__ import annotations

import sys
import time

from megatron.core.errors import AgreedError

EXPECTED_ERRORS = (ValueError, OSError)
# How long a rank other than 0 waits before exiting on an agreed error. All ranks raise it within
# a fraction of a second of each other (the same validation, or after the same collective); the
# rest of the margin covers a loaded machine.
AGREED_EXIT_DELAY_SECONDS = 3.0


def report_error(error: BaseException, rank: int = 0, *, on_every_rank: bool = False) -> int:
    """Print `error` as one line (see the module doc for which rank prints); returns exit status 2.
    `on_every_rank`: the caller knows every rank raised it alike (validation before any process group)."""
    agreed = on_every_rank or isinstance(error, AgreedError)
    if rank == 0 or not agreed:
        where = "" if rank == 0 else f"[rank {rank}] "
        message = " ".join(str(error).split("\n"))
        print(f"error: {where}{message}", file=sys.stderr, flush=True)
    else:  # rank 0 prints this one: exiting first would let torchrun stop rank 0 before it has
        time.sleep(AGREED_EXIT_DELAY_SECONDS)
    return 2
