"""The CPU demo: its config section (:mod:`.config`), what the core sees of it (:mod:`.recipe`, registered under
the entry-point group ``streamgrpo.recipes`` as ``demo``), its assets made in one place (:mod:`.assets`), the
synthetic clips (:mod:`.data`), the format warm start of its tiny model (:mod:`.warm`) and the staleness
benchmark's lag (:mod:`.lag`)."""
