"""Memory: the plan of a rank (static parts, a step's), its placement, the long-video frontier, and the out-of-memory retry.

Modules: :mod:`.frontier`, :mod:`.oom`, :mod:`.placement`, :mod:`.plan`, :mod:`.step`."""
