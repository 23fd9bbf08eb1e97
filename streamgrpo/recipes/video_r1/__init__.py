"""The Video-R1 recipe: its configs (Qwen2.5-VL-3B and 7B on one node, ``video_r1/<name>`` for
``--config``), the step from Video-R1's JSON to the records they read (:mod:`.prepare`) and the README
with the steps from download to ``streamgrpo up`` and the eval sets."""
