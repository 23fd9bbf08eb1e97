"""Commands that are not a role: :mod:`.up` (everything on one machine), :mod:`.evaluate`,
:mod:`.infer`, :mod:`.report`, and :mod:`.k8s_generator` (a generator pod's shard on Kubernetes).
Nothing is imported here."""
