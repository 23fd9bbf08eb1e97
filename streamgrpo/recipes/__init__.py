"""Recipes: a task's knobs, data and warm start, kept out of the core (:mod:`.demo`, the CPU demo)."""
