"""`python -m streamgrpo ...` (used by `torchrun -m streamgrpo learner ...`)."""

import atexit
import gc
import sys

from streamgrpo.runtime import collector

collector.pause()  # until the role has built its model (streamgrpo/runtime/collector.py)

# At exit, once the atexit handlers registered after this one have run (last in, first out) and every
# non-daemon thread has joined: no cyclic garbage collection over the objects torch and transformers leave
# behind, which took 2.3-2.6 s of each role's exit on 2 cores (0.5 s without it, docs/performance.md, the
# test suite's wall time). Reference counting still frees and closes what it holds; an object kept alive
# only by a cycle was never promised a finalizer at exit.
atexit.register(gc.freeze)

from streamgrpo.cli import main  # noqa: E402 - after the handler above, so that it runs last

sys.exit(main())
