"""streamgrpo.transport.queue.redis_stream."""
