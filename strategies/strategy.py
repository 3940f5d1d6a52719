"""The strategy's options base class: what every backend's config declares about itself and
the hooks the suite calls before launch and on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, TypeVar

from pydantic import PrivateAttr

from analysis.projection.strategy_model import StrategyModel
from strategies.runtime.mesh import MeshShape
from strategies.sections import Section, TrainingConfig

if TYPE_CHECKING:
    from torch import nn

    from kan_models.base import ModelConfig
    from strategies.runtime.distributed import DistEnv
    from strategies.step.engine import Engine

# The class of the options resolved: a resolved copy is of the class of the original
Options = TypeVar("Options", bound="StrategyConfig")


class StrategyConfig(Section):
    """A strategy's options, validated from the experiment's ``strategy`` section. Each backend
    subclasses it, narrows ``name`` to a literal and implements :meth:`apply`.

    What varies per strategy is declared here, on the strategy's own class, so that no code
    outside the strategy modules needs to know a strategy by its name."""

    name: str
    # Every strategy but the one-process reference runs inside a process group, a one-rank group included.
    needs_process_group: ClassVar[bool] = True
    # The one-process reference every other strategy is compared with (analysis uses it as the
    # baseline of strategies that never ran on one rank).
    reference: ClassVar[bool] = False
    # The launcher a sweep starts this strategy with; None: the study's launcher.
    preferred_launcher: ClassVar[str | None] = None
    # measurement.comm_probe values this strategy supports besides ``none``.
    probes: ClassVar[frozenset[str]] = frozenset()
    # Whether ``training.compile: step`` compiles this backend's step (tested with parity); DeepSpeed's
    # and Accelerate's engines run their own backward and optimizer step.
    compiles_step: ClassVar[bool] = False
    # Whether ``training.compile: model`` runs under this backend (tensor parallelism's local_map
    # layers are not compiled: untested).
    compiles_model: ClassVar[bool] = True
    # The experiment's model, set by resolved(): a backend may size its config by it (DeepSpeed's "auto").
    _model: ModelConfig | None = PrivateAttr(None)

    def label(self) -> str:
        """The strategy's short name in records, tables, plots and projections: the name plus
        what its options make of it (``zero3_offload``, ``fsdp1_grad_op``). Shipped presets are
        named by their label."""
        return self.name

    def resolved(self: Options, model: ModelConfig) -> Options:
        """These options as the backend will run them for ``model``, where a native config file
        can decide some of them (DeepSpeed's JSON): what the run's record and config.yaml store."""
        resolved = self.model_copy()
        resolved._model = model
        return resolved

    def wrap_units(self, model: nn.Module) -> list[nn.Module]:
        """The submodules a sharding backend wraps one by one: by the experiment's ``model.wrap``
        policy, else the model's own (kan_models/wrap.py)."""
        from kan_models.wrap import wrap_units  # torch, which this module leaves to the backends

        return wrap_units(model, self._model.wrap if self._model is not None else None)

    def resolved_model(self) -> ModelConfig:
        """The experiment's model these options were resolved for (:meth:`resolved`)."""
        if self._model is None:
            raise RuntimeError("the strategy was not resolved for a model; use strategy.resolved(cfg.model)")
        return self._model

    def backend_config_preview(self, training: TrainingConfig, world_size: int) -> tuple[str, dict] | None:
        """What the backend will be given, for ``--dry-run`` (a title and the config), where the
        strategy merges one from several sources; None where it does not."""
        return None

    def mesh_shape(self, world_size: int, ranks_per_node: int | None = None) -> MeshShape:
        """The run's device mesh at ``world_size`` ranks, ``ranks_per_node`` of them on each node
        (None: all on one) (strategies/runtime/mesh.py): whole replicas by default; a sharding backend
        shards over ``dp_shard`` (hybrid sharding: one node's ranks, replicated over ``dp_replicate``),
        tensor parallelism cuts over ``tp``."""
        return MeshShape(dp_replicate=world_size)

    def compute_replica(self, model: nn.Module, env: DistEnv) -> nn.Module:
        """What the compute-only baseline times on this rank (strategies/measure/baseline.py), made from a
        plain copy of the model: the whole model under data parallelism; a backend that splits the
        model returns this rank's part (by its place on ``env.mesh``), with no collectives."""
        return model

    def cost_model(self) -> StrategyModel | None:
        """What this strategy issues per optimizer step and how it holds the model state, for the
        projection (analysis/projection/strategy_model.py), as counted on the suite's runs
        (docs/projection.md); None where its options lead somewhere the projection does not model."""
        return None

    def native_training(self, training: TrainingConfig) -> TrainingConfig:
        """``training`` with what this strategy's native file states of the optimizer, the
        schedule and the precision taken in where the experiment left them open (a DeepSpeed JSON:
        strategies/backends/deepspeed_training.py); its ``_adopted`` says what was taken and from
        where. The default: no such file, nothing taken."""
        adopted = training.model_copy()
        adopted._adopted = {}
        return adopted

    def launch_config(self) -> str | None:
        """The launcher config file this strategy is meant to run under, where it has one."""
        return None

    def missing_precision_support(self, precision: str, device_type: str) -> str | None:
        """What this machine lacks for the backend to compute in ``precision`` (bf16, fp16) on
        ``device_type``, in words; None where nothing is missing. The default is autocast's and
        FSDP's mixed precision (strategies/step/precision_support.py); checked before launch."""
        from strategies.step.precision_support import autocast_lacks  # torch, which this module leaves to the backends

        return autocast_lacks(precision, device_type)

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        """Refuse, before any process starts, what cannot run on ``device_type`` (``cpu`` or
        ``cuda``) at ``world_size``; raise :class:`ConfigError` naming the option and the fix."""

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        """Wrap ``model`` (already on ``env.device``, same initial state on every rank) and
        build its optimizer."""
        raise NotImplementedError
