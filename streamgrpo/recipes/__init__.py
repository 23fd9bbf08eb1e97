"""streamgrpo.recipes."""
