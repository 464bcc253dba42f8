"""The base of every run-config section: a closed, strict pydantic model.

Closed: a key the schema does not name is refused (with the closest valid key, by
``config_errors.translate``). Strict: YAML's ``1`` is not a bool and ``"5"`` is not an
int; ints still widen to float.

Example:
  >>> class LoopSection(ConfigSection):
  ...     epochs: int = 1
  >>> LoopSection.model_validate({"epochs": "5"})  # raises pydantic.ValidationError
"""

from __future__ import annotations

import pydantic

__all__ = ["ConfigSection"]


class ConfigSection(pydantic.BaseModel):
    """A section of a run config (``RunConfig`` and each of its sections)."""

    # strict: YAML's 1 is not a bool and '5' is not an int (ints still widen to float).
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
