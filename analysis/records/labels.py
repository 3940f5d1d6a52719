"""Short names for what a run record describes, shared by every table and plot."""

from __future__ import annotations

from analysis.records.schema import RunRecord


def strategy_label(record: RunRecord) -> str:
    """The strategy's label as the run recorded it (``ddp``, ``fsdp1_grad_op``, ``zero3_offload``,
    ``accelerate_ddp``, ...), with ``+<probe>_probe`` when a measurement probe (the published
    study's, ``paper``) ran alongside and changed the training, and ``+bf16``/``+fp16`` under mixed
    precision, and ``+dataloader_<N>workers`` where the batches came from a DataLoader: a study
    with precision or the data path as an axis compares ``ddp`` with ``ddp+bf16`` and
    ``ddp+dataloader_2workers``; ``+compiled``/``+compiled_step`` for ``training.compile``; and
    ``+checkpointed`` (``+checkpointed_every2``, ...) for ``training.activation_checkpointing``."""
    memory = record.memory
    checkpointed = ""
    if memory is not None and memory.activation_checkpointing == "layers":
        every = memory.activation_checkpointing_every or 1
        checkpointed = "+checkpointed" + (f"_every{every}" if every > 1 else "")
    probe = record.measurement.comm_probe if record.measurement is not None else "none"
    precision = record.precision.setting
    return (
        record.strategy.label
        + ("" if probe == "none" else f"+{probe}_probe")
        + ("" if precision == "fp32" else f"+{precision}")
        + ("" if record.batch.loader == "memory" else f"+dataloader_{record.batch.loader_workers}workers")
        + {"none": "", "model": "+compiled", "step": "+compiled_step"}[record.compile.setting]
        + checkpointed
    )


def topology_label(record: RunRecord) -> str:
    t = record.topology
    return f"{t.nodes}x{t.world_size // t.nodes}"
