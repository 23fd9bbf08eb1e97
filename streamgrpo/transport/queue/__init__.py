"""The queue of scored groups, and all of this project's Redis: :mod:`.base` (the ``GroupQueue`` interface),
:mod:`.factory` (``open_queue``: where roles get theirs), :mod:`.redis_stream` (on a Redis stream, exactly-once with
the learner), :mod:`.keys` (every Redis key), :mod:`.crash_marks` (the learner's crash-loop bookkeeping),
:mod:`.resp` (hand-packed commands and Lua scripts), :mod:`.errors` (what a Redis failure means, in one line),
:mod:`.server` (the embedded redis-server of ``streamgrpo up``)."""
