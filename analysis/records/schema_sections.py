"""The sections a run record (analysis/records/schema.py) is made of: what ran (the strategy, model, task,
topology, batch, precision, compilation and environment), what was measured (timings, throughput,
exposed communication, bytes moved, memory, the measurement's own settings) and why a run failed.
Every section refuses fields it does not declare, so a typo in a writer fails validation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StrategyInfo(Record):
    name: str = Field(description="the backend: strategy.name of the experiment")
    label: str = Field(
        description="what ran, by the name tables, plots, presets and projections use (zero3_offload, "
        "fsdp1_grad_op, accelerate_ddp, ...)"
    )
    reference: bool = Field(False, description="the one-process reference the other strategies are compared with")
    options: dict[str, Any] = Field(
        description="the strategy's options as the backend ran them (the native config file, "
        "the preset and the overrides merged)"
    )
    distributed_type: str | None = Field(
        None, description="what the backend reports it actually ran, e.g. Accelerate's"
    )
    backend_config: dict[str, Any] | None = Field(
        None, description="the backend's own resolved config, e.g. the DeepSpeed JSON"
    )
    adopted: dict[str, str] | None = Field(
        None,
        description="training fields the experiment left open that the native config file decided (its optimizer, "
        "scheduler, fp16/bf16 blocks), each with the file, the key and the value, e.g. "
        "{'training.lr': 'ds.json: optimizer.params.lr = 3e-05'}; None: nothing adopted",
    )


class ModelInfo(Record):
    family: str
    widths: list[int]
    grid: int | None = Field(None, description="grid intervals (spline families) or centres (rbf)")
    order: int | None = Field(None, description="spline order k, or polynomial degree")
    options: dict[str, Any]
    machine_choices: dict[str, str] = Field(
        default_factory=dict,
        description="what the family decided from the machine for options set to auto, and why "
        "(the fast B-spline layer's product: dense or sparse, by this CPU's crossover)",
    )
    params_trainable: int = Field(ge=0)
    params_total: int = Field(ge=0, description="all parameter and buffer elements, as the study counts pykan's")


class TaskInfo(Record):
    name: str
    label: str | None = Field(
        None,
        description="the task as tables name it: the name, with the dataset, file or equation "
        "where there is one (sklearn digits, file houses.csv, feynman I.6.20)",
    )
    goal: Literal["regression", "classification"] | None = Field(None, description="what the model learns")
    input_dim: int = Field(ge=1)
    n_train: int = Field(ge=1)
    n_test: int = Field(ge=0)
    preparation: dict[str, Any] | None = Field(
        None,
        description="what was done to a given table (file tasks): rows_dropped (how many rows task.missing: drop "
        "dropped) and first_rows_dropped (1-based), encoding and encoded ({column: categories})",
    )


class Topology(Record):
    world_size: int = Field(ge=1)
    nodes: int = Field(ge=1)
    procs_per_node: int = Field(ge=1)
    launcher: str = Field(description="none | torchrun | accelerate | deepspeed | slurm")
    comm_backend: str | None = Field(None, description="gloo | nccl | None for one process")
    device_type: str
    device_name: str
    threads_per_rank: int | None = Field(None, ge=1, description="torch intra-op threads of each rank")
    mesh: dict[str, int] | None = Field(
        None,
        description="the run's device mesh, ranks per dimension (dp_replicate: whole replicas, dp_shard: ranks "
        "one replica's state is sharded over, tp: ranks each layer is cut over), laid out row-major "
        "with tp fastest; None in records from before it was kept",
    )


class BatchInfo(Record):
    micro_batch: int = Field(ge=1)
    grad_accum: int = Field(ge=1)
    global_batch: int = Field(ge=1, description="micro_batch x grad_accum x world_size")
    steps: int = Field(ge=0, description="optimizer steps completed")
    epochs: float = Field(ge=0.0, description="passes over the training set completed")
    warmup_steps: int = Field(ge=0)
    timed_steps: int = Field(ge=0)
    loader: Literal["memory", "dataloader"] = Field(
        "memory",
        description="memory: batches indexed from tensors every rank holds; dataloader: a torch DataLoader "
        "with a DistributedSampler and worker processes",
    )
    loader_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank (0 with loader memory)")


class Timings(Record):
    total_s: float = Field(
        ge=0.0, description="sum of all step times, warm-up included (progress reports and checkpoints not)"
    )
    step_mean_s: float = Field(ge=0.0, description="timed steps' wall time (window to window) / their number")
    step_p50_s: float = Field(ge=0.0, description="of the steps' times, slowest rank")
    step_p95_s: float = Field(ge=0.0)
    data_s: float = Field(ge=0.0, description="per step: fetching the batch")
    compute_s: float | None = Field(
        None,
        ge=0.0,
        description="per step: the same per-rank work with no communication, "
        "by the baseline measurement.baseline names, sampled between "
        "timing windows (median); None with baseline off",
    )
    comm_exposed_s: float | None = Field(
        None,
        description="per step: exposed communication by the method comm.trusted "
        "names; None where no method measured it (comm.note says why)",
    )
    compile_s: float | None = Field(None, ge=0.0, description="torch.compile time, excluded from step times")


class Throughput(Record):
    samples_per_s: float = Field(ge=0.0, description="global samples per second over the timed steps")
    samples_per_s_per_rank: float = Field(ge=0.0)
    samples_per_s_low: float | None = Field(None, ge=0.0, description="the slowest timing window's rate")
    samples_per_s_high: float | None = Field(None, ge=0.0, description="the fastest timing window's rate")


class Spread(Record):
    """One per-step quantity over a run's timing windows."""

    median_s: float = Field(description="median over the windows (raw: not clamped)")
    low_s: float = Field(description="lowest window")
    high_s: float = Field(description="highest window")


class CommExposure(Record):
    """Exposed communication per step by two independent methods, and whether they agree."""

    replica: Spread | None = Field(None, description="step time - data - compute of a replica sampled between windows")
    check: Spread | None = Field(
        None, description="time the main thread neither ran nor waited for a core (CPU, one thread per rank)"
    )
    difference_s: float | None = Field(None, description="replica - check, median over windows")
    noise_s: float | None = Field(
        None, ge=0.0, description="how far the difference may stray by chance (see docs/metrics.md)"
    )
    agree: bool | None = Field(None, description="|difference| <= noise; None with one method")
    trusted: Literal["replica", "check", "none"] = Field(
        description="the method comm_exposed_s and comm_overhead use; none: no method measured a time (a baseline "
        "switched off, or every method read below zero)"
    )
    note: str = Field(description="what the two methods say, in words")


class CommBytes(Record):
    """What one step moved, by the links it crossed (strategies/measure/comm_bytes.py)."""

    step: int = Field(ge=1, description="the step counted (the last warm-up step)")
    intra_node_bytes: float = Field(
        ge=0.0, description="bytes a rank sent to ranks of its own node (ring count; max over ranks)"
    )
    inter_node_bytes: float = Field(ge=0.0, description="bytes a rank sent over collectives whose group spans nodes")
    intra_node_collectives: int = Field(ge=0)
    inter_node_collectives: int = Field(ge=0)


class ModelStateBytes(Record):
    params: int = Field(ge=0, description="model parameters (this rank's shards where sharded)")
    grads: int = Field(ge=0)
    optimizer: int = Field(ge=0, description="optimizer state such as Adam's moments")
    master_params: int = Field(0, ge=0, description="fp32 master copies of parameters kept by ZeRO-style optimizers")


class CompileInfo(Record):
    """What ``training.compile`` compiled."""

    setting: Literal["none", "model", "step"] = Field(description="training.compile as asked")
    mechanism: str = Field(description="what was compiled, and how: torch.compile(model), or the step's parts")
    mode: str = Field("default", description="torch.compile's mode (reduce-overhead: CUDA graphs)")
    graph_breaks: list[str] | None = Field(
        None,
        description="the distinct reasons torch.compile broke a graph during this run (rank 0), read at the end "
        "(empty: every compiled region was one graph); None when nothing was compiled",
    )


class PrecisionInfo(Record):
    """What the run computed in, read from the objects that ran it."""

    setting: Literal["fp32", "bf16", "fp16"] = Field(description="training.precision")
    mechanism: str = Field(
        description="how the backend ran it, e.g. torch.autocast(bfloat16), FSDP2 MixedPrecisionPolicy, DeepSpeed bf16"
    )
    param_dtype: str | None = Field(None, description="dtype of the module's parameters as the backend holds them")
    optimizer_dtype: str | None = Field(
        None,
        description="dtype of the tensors the optimizer updates (master copies where the module's are in a low dtype)",
    )
    compute_dtype: str | None = Field(None, description="dtype of the model's output in the last forward pass")


class TensorMemory(Record):
    """Tensor bytes this rank holds at the step's peak, by what they are (torch's MemTracker):
    what an allocator would have to hold, before its own caching and fragmentation."""

    parameters: int = Field(ge=0)
    buffers: int = Field(ge=0)
    gradients: int = Field(ge=0)
    optimizer: int = Field(ge=0, description="optimizer state (and ZeRO's fp32 master copies)")
    activations: int = Field(ge=0, description="activations and tensors saved for the backward")
    temporaries: int = Field(ge=0)
    other: int = Field(ge=0, description="tensors made outside the step, e.g. a backend's buffers")
    peak: int = Field(ge=0, description="all of them at the peak")


class Memory(Record):
    peak_device_bytes: int | None = Field(
        None,
        ge=0,
        description="max_memory_allocated on GPU (max over ranks), during "
        "training steps, less the replica's; None on CPU",
    )
    peak_rss_bytes: int | None = Field(
        None,
        ge=0,
        description="peak resident set size of the process (max over ranks), during training steps, less the replica's",
    )
    replica_bytes: int | None = Field(
        None,
        ge=0,
        description="what the compute baseline held (max over ranks): the replica's tensors, counted "
        "after its warm-up, taken off the peaks (0 with none)",
    )
    model_state: ModelStateBytes = Field(
        description="bytes each kind of model state takes on the rank holding the most of it"
    )
    activation_checkpointing: Literal["none", "layers"] | None = Field(
        None, description="training.activation_checkpointing as the run ran it; None in records from before it was kept"
    )
    activation_checkpointing_every: int | None = Field(
        None, ge=1, description="training.activation_checkpointing_every (with layers)"
    )
    checkpointed_units: int | None = Field(
        None, ge=0, description="the model's units whose activations were checkpointed (0 with none)"
    )
    activations_after_forward_bytes: int | None = Field(
        None,
        ge=0,
        description="activations a forward pass left for its backward, at its end (the largest "
        "micro-batch's, max over ranks; torch's MemTracker) on the counted step; None where "
        "no step was counted (one compiled, or a run resumed past its warm-up)",
    )
    step_peak: TensorMemory | None = Field(
        None,
        description="the counted step's tensors at its peak by category (each the max over ranks; "
        "tensors made before the step that the tracker was not given count nowhere)",
    )


class Flops(Record):
    """What one training step computes, counted on one step by torch's FlopCounterMode formulas
    (matrix products, convolutions, attention; elementwise work counts nothing)."""

    step: int = Field(ge=1, description="the step counted (the last warm-up step)")
    model_per_sample: float = Field(
        ge=0.0, description="FLOPs per sample of forward and backward, recomputation excluded (all ranks' / samples)"
    )
    hardware_per_sample: float = Field(
        ge=0.0,
        description="FLOPs per sample the ranks ran, activation checkpointing's recomputed forwards included",
    )


class OutsideLoad(Record):
    """What other processes took of the run's machine while it was timed (the busiest machine)."""

    cores_busy: float = Field(
        ge=0.0,
        description="cores kept busy by other processes, on average over the timed windows "
        "(/proc/stat busy time of the run's cores less the run's own CPU time)",
    )
    run_cores_busy: float = Field(ge=0.0, description="cores the run's own processes kept busy on that machine")
    cores: int = Field(ge=1, description="cores the run's ranks could run on there")
    seconds: float = Field(ge=0.0, description="wall time it was measured over")


class MeasurementInfo(Record):
    comm_method: str = Field(description="how comm.replica was measured")
    comm_probe: str = Field(
        "none", description="measurement.comm_probe: none, or paper (the published study's probe ran)"
    )
    baseline: Literal["replica", "layerwise", "off"] = Field(
        "replica", description="the compute baseline that ran (measurement.baseline, auto resolved)"
    )
    baseline_steps: int = Field(ge=0, description="baseline steps timed after each window")
    check_method: str | None = Field(None, description="how comm.check was measured, if it was")
    timing: Literal["windowed", "per_step"] = Field(
        "windowed", description="windowed: ranks synchronize once per window; per_step: a barrier around every step"
    )
    window_steps: int = Field(1, ge=1, description="steps per timing window")
    windows: int = Field(0, ge=0, description="timed windows the spreads are over")
    outside_load: OutsideLoad | None = Field(
        None,
        description="other processes' use of the machine during the timed windows; None where the kernel does not say",
    )
    paper_probe_overhead: float | None = Field(
        None,
        description="with measurement.comm_probe=paper: the published study's (t2 - t1) / t2, mean over probed batches",
    )


class Environment(Record):
    python: str
    torch: str
    deepspeed: str | None = None
    accelerate: str | None = None
    pykan: str | None = None
    platform: str
    hosts: list[str] = Field(description="the machines the ranks ran on (under SLURM, its node names)")
    rank_hosts: list[str] | None = Field(
        None,
        description="each rank's machine, in rank order: which ranks shared a "
        "node (None in records from before it was kept)",
    )
    cpu_count: int | None = Field(None, ge=1, description="CPU cores rank 0 could run on (its affinity mask)")
    gpu_model: str | None = None
    slurm_job_id: str | None = Field(None, description="the SLURM job the run ran in, if any")


class RunError(Record):
    type: str
    message: str
    rank: int | None = None
    step: int | None = Field(None, description="last completed step")
