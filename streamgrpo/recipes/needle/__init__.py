"""The needle recipe: long videos (256 frames) where the answer rests on one brief coloured flash
(:mod:`.data`); ``streamgrpo up --config demo-needle`` trains the tiny model on it (the demo recipe builds
the model and, with ``demo.task: needle``, this data set)."""
