"""Process plumbing every role shares, by concept: :mod:`.processes` (stop requests, children, threads, free
ports), :mod:`.run_dir` (one owner per run directory, an earlier run's outputs moved aside), :mod:`.jsonl` (the run
directory's JSON and JSONL files), :mod:`.accuracy` (time to target), :mod:`.collector` (no cyclic garbage
collection while a process starts). No training logic lives here; the metrics endpoint is
:mod:`streamgrpo.metrics`'s, the Redis URL the queue's (:mod:`streamgrpo.transport.queue.factory`)."""
