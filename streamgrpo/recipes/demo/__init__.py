"""streamgrpo.recipes.demo."""
