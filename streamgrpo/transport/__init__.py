"""Transports between processes, one folder per channel: the Redis queue of scored groups
(:mod:`.queue`) and the weight channel (:mod:`.weights`), each with a small interface in ``base.py``,
one module per backend, and one factory that reads its backend key. Import the submodules directly;
this package imports nothing heavy."""
