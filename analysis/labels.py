"""Short names for what a run record describes, shared by every table and plot."""

from __future__ import annotations

from analysis.schema import RunRecord


def strategy_label(record: RunRecord) -> str:
    """``ddp``, ``fsdp1``, ``fsdp1-shard_grad_op``, ``fsdp2``, ``fsdp2-keep``, ``zero0``..``zero3``,
    ``zero3-offload``, ``accelerate-multi_cpu``: the strategy plus the options that change what
    it is; ``+paper-probe`` when the published study's probe ran alongside."""
    probe = record.measurement is not None and record.measurement.comm_probe == "paper"
    return backend_label(record) + ("+paper-probe" if probe else "")


def backend_label(record: RunRecord) -> str:
    name, options = record.strategy.name, record.strategy.options
    if name == "fsdp1" and options.get("sharding_strategy", "FULL_SHARD") != "FULL_SHARD":
        return f"fsdp1-{options['sharding_strategy'].lower()}"
    if name == "fsdp2" and options.get("reshard_after_forward") is False:
        return "fsdp2-keep"
    zero = (record.strategy.backend_config or {}).get("zero_optimization")
    if zero is not None:
        offloaded = any((zero.get(k) or {}).get("device", "none") != "none" for k in ("offload_optimizer", "offload_param"))
        label = f"zero{zero.get('stage', 0)}" + ("-offload" if offloaded else "")
        return label if name == "deepspeed" else f"accelerate-{label}"
    if name == "accelerate" and record.strategy.distributed_type:
        return f"accelerate-{record.strategy.distributed_type.lower()}"
    return name


def topology_label(record: RunRecord) -> str:
    t = record.topology
    return f"{t.nodes}x{t.world_size // t.nodes}"
