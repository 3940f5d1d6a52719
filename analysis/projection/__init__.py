"""Scaling projection: step time, speedup, parallel efficiency, exposed communication and per-rank
model-state bytes of every strategy at P ranks over N nodes, from a measured compute profile and a
network description (``kanscale commbench`` fits or a cluster file). Pure functions on numbers:
nothing here starts a process group.

Everything this package produces is a projection, not a measurement; docs/projection.md states the
model, its assumptions and how far it lands from measured runs. One module per subject:

- ``collectives``: what one collective costs on a link (the ring model, nccl-tests' bus-bandwidth
  factors, the alpha-beta fit) and the network, read from commbench results or a cluster file;
- ``inputs``: the model's parameter layout and the measured compute profile of one rank;
- ``strategy_model``: what each strategy issues per step and the model state it holds;
- ``step_model``: the step's schedule, and every strategy projected over rank counts;
- ``output``: the assumptions, the table, the Markdown and the JSON document.

``from analysis import projection as pj`` gives every public name of the five; ``memory`` (a
rank's peak by part) and ``advice`` (each strategy laid out on a target and ranked) build on them,
``uncertainty`` (a stated input's range, and the ends a prediction is made at) beneath them.
"""

from analysis.projection.collectives import (
    HOST_COPY,
    OPS,
    Fit,
    LinkCost,
    MiB,
    Network,
    busbw_factor,
    fit_alpha_beta,
    network_from_cluster,
    network_from_commbench,
    ring_steps,
)
from analysis.projection.inputs import (
    EXPERIMENT,
    PAPER_BATCH,
    ComputeProfile,
    ModelShape,
    median_profile,
    paper_profile,
    profile_from_bench,
    profile_from_record,
    profiles_from_runs,
)
from analysis.projection.output import assumptions, document, markdown, table
from analysis.projection.step_model import (
    TAKEOVER_SEARCH,
    Projection,
    Scenario,
    nodes_for,
    project,
    project_step,
    search_limit,
    takeover,
)
from analysis.projection.strategy_model import (
    ADAM_BYTES_PER_PARAM,
    DDP_BUCKET,
    DDP_FIRST_BUCKET,
    Exchange,
    StrategyModel,
    ddp_buckets,
    model_state,
    tp_exchanges,
)

__all__ = [
    "ADAM_BYTES_PER_PARAM",
    "DDP_BUCKET",
    "DDP_FIRST_BUCKET",
    "EXPERIMENT",
    "HOST_COPY",
    "OPS",
    "PAPER_BATCH",
    "TAKEOVER_SEARCH",
    "ComputeProfile",
    "Exchange",
    "Fit",
    "LinkCost",
    "MiB",
    "ModelShape",
    "Network",
    "Projection",
    "Scenario",
    "StrategyModel",
    "assumptions",
    "busbw_factor",
    "ddp_buckets",
    "document",
    "fit_alpha_beta",
    "markdown",
    "median_profile",
    "model_state",
    "network_from_cluster",
    "network_from_commbench",
    "nodes_for",
    "paper_profile",
    "profile_from_bench",
    "profile_from_record",
    "profiles_from_runs",
    "project",
    "project_step",
    "ring_steps",
    "search_limit",
    "table",
    "takeover",
    "tp_exchanges",
]
