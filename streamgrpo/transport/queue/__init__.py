"""The queue of scored groups: :mod:`.base` (the ``GroupQueue`` interface), :mod:`.redis_stream` (on a
Redis stream, exactly-once with the learner), :mod:`.resp` (its hand-packed commands and Lua
scripts), :mod:`.errors` (what a Redis failure means, in one line), :mod:`.server` (the embedded
redis-server of ``streamgrpo up``)."""
