"""streamgrpo.learner.loop."""
