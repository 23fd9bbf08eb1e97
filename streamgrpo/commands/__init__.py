"""Commands that are not a role: :mod:`.up` (everything on one machine), :mod:`.evaluate`,
:mod:`.infer` and :mod:`.report`. Nothing is imported here."""
