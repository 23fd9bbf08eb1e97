"""One module per command of the `streamgrpo` command line (streamgrpo/cli.py names each command's function as
``run="module:function"`` and imports its module only when that command runs): the roles (:mod:`.learner`,
:mod:`.generator`, :mod:`.evaluator`, :mod:`.relay`), :mod:`.up` (everything on one machine), :mod:`.slurm`, and
the tools. Nothing is imported here."""
