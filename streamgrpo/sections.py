"""What every config section shares, the core's (:mod:`streamgrpo.config`) and the recipes' (registered through
:mod:`streamgrpo.config.recipes`): unknown keys are errors, every field is documented by the docstring under it,
every float rejects NaN and +-inf; and the one error type of a wrong config. Outside :mod:`streamgrpo.config`
because a recipe's section is imported while that package builds its schema."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key, the value and the source."""


class Section(BaseModel):
    # allow_inf_nan=False: every float field rejects NaN and +-inf ("must be a finite number"), whatever its bounds
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)
