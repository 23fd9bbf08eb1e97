"""Where things are, for tests in any folder under tests/ (their depth differs: tests/unit/learner/checkpoint/...).

``REPO`` is the repository root; ``TESTS`` is tests/; ``GOLDEN`` is tests/golden/ (the golden wire and weight files).
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GOLDEN = TESTS / "golden"
