"""Data: records (JSON/JSONL, HF datasets), frame sampling and decoding, prompts, checks.

Modules: :mod:`.records` (Record, load_records, DataError), :mod:`.sampling` (smart_resize,
smart_nframes, budget planning), :mod:`.decode` (decord/PyAV readers, images, caches),
:mod:`.video` (load_visuals), :mod:`.prompts` (chat text, processor inputs), :mod:`.dataset`
(iter_samples), :mod:`.check` (run_check). Nothing is imported here so
that ``streamgrpo --help`` stays fast.
"""
