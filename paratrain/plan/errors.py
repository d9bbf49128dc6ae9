"""The planner's error: its own module, so that every planner module (hardware profiles too) can raise it
without importing the memory model."""

from __future__ import annotations

from paratrain.errors import ParatrainError


class PlanError(ParatrainError, ValueError):
    """Bad input to the planner; the message names the field and the fix."""
