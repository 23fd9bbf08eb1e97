"""The learner role: groups from the queue in, optimizer steps, checkpoints and weight versions out.

:mod:`.loop` is the process (``run_learner``); :mod:`.gate`, :mod:`.poison` and :mod:`.resume` are
the steps around a training step; :mod:`.trainer` (``Learner``) is the step itself, with the pure
:mod:`.micro_batches`, :mod:`.optim`, :mod:`.update_guard`, :mod:`.step_data`, :mod:`.flops` and
:mod:`.memory`; :mod:`.checkpoint`, :mod:`.distributed`, :mod:`.deepspeed_setup` and :mod:`.tracking`
are its plumbing. Nothing is imported here.
"""
