"""streamgrpo.commands."""
