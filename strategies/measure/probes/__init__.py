"""Measurement probes a strategy may support besides the suite's own measurement, by the name
``measurement.comm_probe`` gives them. They live outside the generic loop, which only calls
:class:`StepProbe`'s hooks."""

from __future__ import annotations

from strategies.measure.probes.paper import PaperProbe
from strategies.measure.probes.probe import StepProbe
from strategies.runtime.distributed import DistEnv

# name -> (what it is, for messages; how it is built)
PROBES = {
    "paper": "the published study's DDP instrumentation, which changes the gradients",
}
_BUILDERS = {"paper": PaperProbe}


def build_probe(name: str, env: DistEnv) -> StepProbe | None:
    """The probe ``measurement.comm_probe`` names; None for ``none``."""
    return _BUILDERS[name](env) if name in _BUILDERS else None
