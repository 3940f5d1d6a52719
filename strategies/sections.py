"""The experiment's sections that belong to training itself: hyperparameters, measurement,
runtime, fault injection and output. :mod:`strategies.experiment` assembles them with the model,
the task and the strategy (:mod:`strategies.strategy`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from kan_models.base import NumbersNotBooleans, Seed
from kanscale.errors import ConfigError
from kanscale.extras import require

if TYPE_CHECKING:
    from strategies.runtime.mesh import MeshShape


class Section(NumbersNotBooleans):
    # Unknown keys are refused (a misspelling would otherwise be ignored), and so are infinite
    # and NaN floats (YAML's .inf, .nan): every bound a field declares holds for them or not by
    # accident (lr: .inf is "greater than 0"), and no hyperparameter, timeout or size means them.
    # A boolean for a number is refused by the base class (true would be 1).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ScheduleConfig(Section):
    """The learning rate over the optimizer steps, as DeepSpeed's schedulers define it (WarmupLR,
    WarmupDecayLR, WarmupCosineLR; strategies/step/schedule.py computes it), applied the same way by
    every backend. ``training.lr`` is the peak."""

    name: Literal["constant", "warmup", "warmup_decay", "warmup_cosine"] = Field(
        "constant",
        description="constant: training.lr throughout; warmup (DeepSpeed's WarmupLR): from warmup_min_lr "
        "up to training.lr over warmup_steps, then constant; warmup_decay (WarmupDecayLR): the "
        "same warm-up, then linear decay to 0 at total_steps; warmup_cosine (WarmupCosineLR): "
        "from warmup_min_ratio x training.lr up to training.lr, then a cosine down to "
        "cos_min_ratio x training.lr at total_steps",
    )
    warmup_steps: int | None = Field(
        None,
        ge=1,
        description="optimizer steps of the learning-rate warm-up (not training.warmup_steps, which are "
        "the steps left out of timing); DeepSpeed warms up over at least 2; default: a tenth of "
        "total_steps, rounded up",
    )
    warmup_type: Literal["log", "linear"] = Field(
        "log", description="the warm-up's curve, DeepSpeed's warmup_type (log is its default)"
    )
    warmup_min_lr: float = Field(
        0.0, ge=0.0, description="warmup, warmup_decay: the learning rate the warm-up starts from"
    )
    warmup_min_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="warmup_cosine: the warm-up's start, as a fraction of training.lr"
    )
    cos_min_ratio: float = Field(
        1e-4,
        ge=0.0,
        le=1.0,
        description="warmup_cosine: the end of the cosine, as a fraction of training.lr (DeepSpeed's default)",
    )
    total_steps: int | None = Field(
        None,
        ge=1,
        description="warmup_decay, warmup_cosine: the step the decay ends at; default: the run's optimizer steps",
    )

    @model_validator(mode="after")
    def _warmup_before_the_end(self) -> ScheduleConfig:
        if self.total_steps is not None and self.warmup_steps is not None and self.total_steps < self.warmup_steps:
            raise ValueError(
                f"total_steps {self.total_steps} is fewer than warmup_steps {self.warmup_steps}: the decay would end "
                f"before the warm-up does; raise training.schedule.total_steps to at least {self.warmup_steps} or "
                f"lower training.schedule.warmup_steps"
            )
        return self


class TrainingConfig(Section):
    """Every hyperparameter, passed explicitly to whichever backend trains the model."""

    seed: Seed = Field(
        0,
        description="seeds the data, the initial weights and the data order; 0 <= seed < 2^32 "
        "(NumPy's seeding, which pykan uses, takes no more)",
    )
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = Field(1e-3, gt=0.0, description="the learning rate (the peak of training.schedule)")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="the learning rate per step")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam/AdamW betas")
    eps: float = Field(1e-8, gt=0.0, description="Adam/AdamW epsilon")
    weight_decay: float = Field(0.0, ge=0.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0, description="SGD momentum")
    grad_clip: float = Field(0.0, ge=0.0, description="max global gradient norm; 0 = off")
    micro_batch: int | None = Field(512, ge=1, description="samples per rank per forward/backward")
    global_batch: int | None = Field(
        None, ge=1, description="samples per optimizer step over all ranks; when set, micro_batch is derived from it"
    )
    grad_accum: int = Field(1, ge=1, description="micro-batches accumulated per optimizer step")
    epochs: float | None = Field(1, gt=0.0, description="passes over the training set (or set steps)")
    steps: int | None = Field(None, ge=1, description="optimizer steps; overrides epochs when set")
    loader: Literal["memory", "dataloader"] = Field(
        "memory",
        description="memory: each rank indexes its batches from tensors it holds (the suite's own split); "
        "dataloader: a torch DataLoader with a DistributedSampler and worker processes",
    )
    loader_workers: int = Field(
        2, ge=0, description="with loader dataloader: worker processes per rank (0: load in the training process)"
    )
    warmup_steps: int = Field(5, ge=0, description="first steps excluded from timing")
    dtype: Literal["float32", "float64"] = Field(
        "float32", description="dtype of the parameters (and of the master copies under mixed precision)"
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="fp32: compute in training.dtype; bf16/fp16: mixed precision, by each backend's own "
        "mechanism (docs/precision.md)",
    )
    compile: Literal["none", "model", "step"] = Field(
        "none",
        description="model: torch.compile the model; step: compile the whole step (forward and loss as one "
        "graph, the backward by compiled autograd where the backend allows, the optimizer step); "
        "compile times are recorded apart from step times (docs/performance.md)",
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile's mode; reduce-overhead captures CUDA graphs (CUDA only)"
    )
    activation_checkpointing: Literal["none", "layers"] = Field(
        "none",
        description="layers: keep no activations inside the model's units (a zoo model's KAN layers, a custom "
        "model's model.wrap units) but recompute them in backward (torch's non-reentrant checkpoint), "
        "under every strategy, applied before the strategy wraps the model: less memory for more "
        "compute (docs/memory.md)",
    )
    activation_checkpointing_every: int = Field(
        1, ge=1, description="with activation_checkpointing layers: every Nth unit only (1: every unit)"
    )
    grid_update_every: int = Field(0, ge=0, description="refit spline grids every N steps; 0 = never")
    grid_update_until: int | None = Field(None, ge=1, description="last step at which grids are refitted")
    log_every: int = Field(
        0, ge=0, description="steps between progress reports (made at the end of a timing window); 0 = about 20 per run"
    )
    checkpoint_every: int = Field(0, ge=0, description="write a checkpoint every N steps; 0 = never")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept per run (older ones are deleted)")
    init_from: str | None = Field(None, description="start from the weights of a model exported by kanscale export")
    # What a native DeepSpeed file decided of these values, field -> where (set once, by
    # strategies/backends/deepspeed_training.py: with_native_training); None: not asked yet.
    _adopted: dict[str, str] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _valid_combination(self) -> TrainingConfig:
        for beta in self.betas:
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas must each lie in [0, 1), got {list(self.betas)}")
        if self.epochs is None and self.steps is None:
            raise ValueError("set either epochs or steps")
        if self.activation_checkpointing_every > 1 and self.activation_checkpointing == "none":
            raise ValueError(
                f"activation_checkpointing_every {self.activation_checkpointing_every} needs units to "
                "checkpoint; set training.activation_checkpointing=layers (or leave the other unset)"
            )
        if self.compile != "none" and self.activation_checkpointing != "none":
            # the composable checkpoint's hooks recompute a unit eagerly in backward, while its forward
            # ran in the compiled graph, which saves other tensors: the first backward fails
            raise ValueError(
                f"compile {self.compile} with activation_checkpointing {self.activation_checkpointing}: "
                "torch.compile traces the checkpointed layers' forward but not their recomputation, so the "
                "first backward would fail; set training.compile=none, or training.activation_checkpointing=none"
            )
        if self.precision != "fp32" and self.dtype != "float32":
            raise ValueError(
                f"precision {self.precision} keeps float32 master weights, but dtype is {self.dtype}; "
                "set training.dtype=float32 (or training.precision=fp32)"
            )
        if self.compile == "step" and self.schedule.name != "constant":
            raise ValueError(
                f"compile step compiles the optimizer step with the learning rate as a constant, so "
                f"schedule {self.schedule.name} would recompile it every step; use compile model, or "
                "training.schedule.name=constant"
            )
        if self.compile == "step" and self.precision == "fp16":
            raise ValueError(
                "compile step cannot compile fp16's GradScaler step (it asks the host whether a gradient "
                "overflowed each step); use precision bf16, or compile model"
            )
        if self.compile_mode != "default" and self.compile == "none":
            raise ValueError(
                f"compile_mode {self.compile_mode} needs something compiled; set training.compile to model or step"
            )
        if self.schedule.name in ("warmup", "warmup_decay") and self.schedule.warmup_min_lr >= self.lr:
            raise ValueError(
                f"schedule.warmup_min_lr {self.schedule.warmup_min_lr:g} is not below lr {self.lr:g}: the warm-up "
                "would not rise to training.lr; lower training.schedule.warmup_min_lr (0 by default) or raise "
                "training.lr"
            )
        if (
            self.grid_update_every
            and self.grid_update_until is not None
            and self.grid_update_until < self.grid_update_every
        ):
            raise ValueError(
                f"grid_update_until {self.grid_update_until} comes before the first refit at step "
                f"{self.grid_update_every} (grid_update_every): no grid would be refitted; raise "
                "training.grid_update_until or set training.grid_update_every=0"
            )
        if (self.micro_batch is None) == (self.global_batch is None):
            raise ValueError(
                "set exactly one of micro_batch (per rank) and global_batch (over all ranks); set the other to null"
            )
        return self

    def micro_batch_for(self, shares: int) -> int:
        """Samples per rank per micro-step when every global batch is cut into ``shares``
        (the world size under data parallelism; the data-parallel size under tensor parallelism)."""
        if self.micro_batch is not None:
            return self.micro_batch
        assert self.global_batch is not None, "validation leaves exactly one of micro_batch and global_batch"
        ranks_x_accum = self.grad_accum * shares
        if self.global_batch % ranks_x_accum:
            raise ConfigError(
                f"training.global_batch: {self.global_batch} samples cannot be split evenly over grad_accum "
                f"({self.grad_accum}) x data-parallel ranks ({shares}) = {ranks_x_accum}; "
                f"use a multiple of {ranks_x_accum}"
            )
        return self.global_batch // ranks_x_accum


class MeasurementConfig(Section):
    timing: Literal["windowed", "per_step"] = Field(
        "windowed",
        description="windowed: ranks synchronize once per window of steps, as training does not at all; "
        "per_step: a barrier (and device synchronize) around every step, for per-step distributions",
    )
    window_steps: int = Field(10, ge=1, description="steps per timing window (rates and spreads are per window)")
    baseline: Literal["auto", "replica", "layerwise", "off"] = Field(
        "auto",
        description="the compute-only baseline exposed communication is measured against. replica: a whole "
        "unsharded copy of the model and its optimizer on every rank; layerwise: one sharded unit at "
        "a time and the optimizer over this rank's shard, never more than a sharding strategy's own "
        "share; off: none, and no exposed-communication figure; auto: layerwise where the strategy "
        "shards over dp_shard (FSDP, ZeRO 1-3) and nothing is compiled, else replica",
    )
    baseline_steps: int = Field(
        2,
        ge=1,
        description="steps of the compute-only baseline timed after each window (their median is the window's "
        "compute time, which exposed communication is measured against)",
    )

    @field_validator("baseline", mode="before")
    @classmethod
    def _unquoted_off(cls, value: object) -> object:
        return "off" if value is False else value  # YAML 1.1 reads an unquoted off as false

    def baseline_for(self, mesh: MeshShape, compile: str) -> str:
        """The baseline a run with this mesh and ``training.compile`` setting takes (auto resolved)."""
        if self.baseline != "auto":
            return self.baseline
        return "layerwise" if mesh.dp_shard > 1 and mesh.tp == 1 and compile == "none" else "replica"

    comm_probe: Literal["none", "paper"] = Field(
        "none",
        description="paper: also run the published study's probe (every second batch two extra forwards and an "
        "extra all-reduce that changes the gradients), for comparison only; needs strategy ddp",
    )


class RuntimeConfig(Section):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads per rank; default: torch's")
    timeout_s: float = Field(
        120.0,
        ge=1.0,
        description="collective timeout: a rank waiting longer on the others fails. At least 1 s: the "
        "same timeout bounds connecting to the launcher's store and forming the process group; a "
        "healthy rank may also reach a collective later than the others by whatever it does alone "
        "(writing a checkpoint, the record)",
    )


class FaultConfig(Section):
    """Fault injection, for testing how failures are handled: at the start of ``step`` the chosen
    rank(s) raise an exception, exit at once (no cleanup, like a crash), or hang."""

    rank: int | Literal["all"] = Field(description="the rank that fails, or all")
    step: int = Field(ge=1, description="the step (1-based) at whose start it fails")
    kind: Literal["exception", "exit", "hang"] = "exception"


class TrackingConfig(Section):
    report_to: list[Literal["tensorboard", "mlflow"]] = Field(
        default_factory=list,
        description="experiment trackers that also get each step's loss, learning rate, rate and "
        "communication, rank 0's memory, the run's settings and its results (Accelerate's log_with): "
        "tensorboard writes OUT/<run_id>/tensorboard/; mlflow logs to MLFLOW_TRACKING_URI, else OUT/mlruns",
    )

    @field_validator("report_to")
    @classmethod
    def _installed(cls, trackers: list[str]) -> list[str]:
        for tracker in dict.fromkeys(trackers):
            require(tracker, f"tracking.report_to: {tracker}")
        return list(dict.fromkeys(trackers))


class OutputConfig(Section):
    dir: str = Field("runs", description="run records go to DIR/<run_id>/")
