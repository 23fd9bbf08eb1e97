"""The CPU demo: its config section (:mod:`.config`), its assets made in one place (:mod:`.assets`),
the synthetic clips (:mod:`.data`) and the format warm start of its tiny model (:mod:`.warm`)."""
