"""What every config section shares (:mod:`streamgrpo.sections`, outside this package so that a section
defined elsewhere, the demo recipe's, can be imported first without a cycle through this package's
``__init__``, which loads the schema that includes it)."""

from streamgrpo.sections import ConfigError, Section

__all__ = ["ConfigError", "Section"]
