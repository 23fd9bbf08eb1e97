"""Checkpoints: their files, the background writer, DeepSpeed ranks' parts, the commit that follows a checkpoint, resume and resharding.

Modules: :mod:`.background`, :mod:`.commit`, :mod:`.files`, :mod:`.ranks`, :mod:`.reshard`, :mod:`.resume`."""
