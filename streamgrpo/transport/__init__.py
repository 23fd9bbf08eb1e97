"""Transports between processes: the Redis replay queue (:mod:`.queue`, :mod:`.redis_server`) and the
ZeroMQ weight channel. Import the submodules directly; this package imports nothing heavy."""
