"""``python -m streamgrpo.learner.ranks ARGS``: torchrun (``torch.distributed.run``, the same arguments) as ``up`` and the
Slurm job launch several learner ranks, ending in one line where torchrun ends in a traceback.

torchrun stops its ranks and re-raises when it is sent SIGTERM or SIGINT (``up`` stopping, Slurm's preemption and
requeue, Ctrl-C), and raises ``ChildFailedError`` with a table when a rank fails; both reach the top as a traceback
in the learner's log, though nothing went wrong in the launcher (a stop) or the failing rank said why already. Here
a stop prints ``learner ranks: stopped by SIGTERM`` and exits 128 + the signal's number, as a shell reports it; a
failed rank prints which rank and its exit code, and the launcher exits with that code (1 for a rank killed by a
signal). Everything else is torchrun's own.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun(argv)
    except SignalException as exc:
        sig = int(exc.sigval)
        print(f"learner ranks: stopped by {signal.Signals(sig).name} (torchrun stopped the ranks)", file=sys.stderr)
        return 128 + sig
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        print(f"learner ranks: rank {rank} {how} (its own lines above say why); the other ranks were stopped",
              file=sys.stderr)
        return code if code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
