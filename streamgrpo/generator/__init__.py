"""streamgrpo.generator.loop."""
