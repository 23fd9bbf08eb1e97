"""`python -m streamgrpo ...` (used by `torchrun -m streamgrpo learner ...`)."""

import sys

from streamgrpo.cli import main

sys.exit(main())
