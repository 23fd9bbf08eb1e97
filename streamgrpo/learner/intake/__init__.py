"""What admits a group into a step: the checks, the screens before decoding, the media, the crash-loop breaker and the poison probe.

Modules: :mod:`.checks`, :mod:`.crash_loop`, :mod:`.death_cause`, :mod:`.gate`, :mod:`.limits`, :mod:`.media`, :mod:`.poison`, :mod:`.screen`."""
