"""The interface of a measurement probe: extra instrumentation a strategy may support
(``probes`` on its config class), run by the loop at one fixed point of every step."""

from __future__ import annotations

from typing import Any

from strategies.step.engine import Batch, Engine


class StepProbe:
    def after_backward(self, engine: Engine, batches: list[Batch], step: int) -> None:
        """Called after a step's forward and backward, before its optimizer step (0-based ``step``)."""

    def results(self) -> dict[str, Any]:
        """Fields of the record's ``measurement`` section (a collective: every rank calls it)."""
        return {}
