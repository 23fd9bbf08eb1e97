"""streamgrpo.transport.weights.publisher."""
