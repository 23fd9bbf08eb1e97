"""The generator role: prompts in, scored groups out (:mod:`.loop`, ``run_generator``).

:mod:`.sampling` turns prompts into scored groups, :mod:`.send` puts them in the queue,
:mod:`.applier` applies weight versions at safe points, :mod:`.weights_watch` makes a generator
without weights loud; :mod:`.rollouts` makes real groups without a process (tests, benchmarks).
Nothing is imported here.
"""
