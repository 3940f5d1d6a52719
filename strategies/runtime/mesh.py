"""The run's device mesh: how its ranks are laid out over data-parallel replication, data-parallel
sharding and tensor parallelism.

A strategy declares the sizes of the three dimensions for a world size
(:meth:`StrategyConfig.mesh_shape`); the loop builds one :class:`RunMesh` from them before it cuts
any batch, and every part of the run reads its position from it: the data loader and evaluation
their data-parallel share, the record how many ranks hold one replica (and so see the same samples
and loss), and the backends the named sub-meshes they work over (``mesh["tp"]``,
``mesh["dp_shard"]``, ``mesh["dp"]`` for both data-parallel dimensions flattened), as torchtitan's
``ParallelDims`` hands them to each ``apply_*``.

Ranks are laid out row-major, ``tp`` fastest: the ranks of one model replica are consecutive, so
they share a node wherever a node holds a whole replica, and the shard groups inside the replicas
come next. The torch ``DeviceMesh`` itself (its process groups) is made on first use, by the
backends that ask for a sub-mesh, at the same point on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kanscale.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DIMS = ("dp_replicate", "dp_shard", "tp")
DP = ("dp_replicate", "dp_shard")  # flattened, the sub-mesh named "dp"


@dataclass(frozen=True)
class MeshShape:
    """Ranks along each mesh dimension; their product is the world size."""

    dp_replicate: int = 1  # whole replicas of the model state (DDP; ZeRO-0)
    dp_shard: int = 1  # ranks the model state is sharded over (FSDP, ZeRO 1-3)
    tp: int = 1  # ranks each layer is cut over

    @classmethod
    def with_tp(cls, world_size: int, tp: int, field: str, dp: str = "dp_shard") -> MeshShape:
        """``tp`` ranks per replica and the rest data parallel along ``dp``; ``field`` names the
        option that set ``tp``, for the error where it does not divide the world."""
        if tp < 1 or world_size % tp:
            raise ConfigError(
                f"{field}: {tp} does not divide the world size {world_size} (dp x tp = world size); "
                f"launch a multiple of {tp} ranks or change {field.split('.')[-1]}"
            )
        return cls(**{dp: world_size // tp, "tp": tp})

    @classmethod
    def hybrid(cls, world_size: int, shard_degree: int | str, ranks_per_node: int | None, field: str) -> MeshShape:
        """Hybrid sharding: the model state sharded over ``shard_degree`` consecutive ranks (``node``:
        the ranks of one node, ``world``: every rank) and replicated over the groups that makes.
        Row-major, the shard groups are consecutive ranks, so a node that holds a whole group keeps
        the group's all-gathers and reduce-scatters on its own links and only the replicas'
        all-reduce crosses nodes. ``field`` names the option, for the errors."""
        per_node = ranks_per_node or world_size
        named = {"node": per_node, "world": world_size}
        shard = named.get(shard_degree) if isinstance(shard_degree, str) else shard_degree
        if shard is None or shard < 1 or world_size % shard:
            raise ConfigError(
                f"{field}: {shard_degree} ranks per shard group does not divide the world size "
                f"{world_size} (replicas x shard degree = world size); give a divisor of {world_size}, "
                "or node (the ranks of one node) or world (every rank)"
            )
        if shard_degree != "node" and shard % per_node and per_node % shard:
            raise ConfigError(
                f"{field}: shard groups of {shard} ranks on nodes of {per_node} would cut a group across "
                f"a node boundary and leave others inside it; give a divisor or a multiple of {per_node} "
                "(node: one node's ranks)"
            )
        return cls(dp_replicate=world_size // shard, dp_shard=shard)

    def sizes(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in DIMS}

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes().values())

    @property
    def dp(self) -> int:
        """How many shares every global batch is cut into: the data-parallel degree."""
        return self.dp_replicate * self.dp_shard


class RunMesh:
    """This rank's place on the run's mesh, and the mesh's named sub-meshes (see the module docstring)."""

    def __init__(self, shape: MeshShape, rank: int, device_type: str) -> None:
        self.shape, self.rank, self.device_type = shape, rank, device_type
        if not 0 <= rank < shape.world_size:
            raise ValueError(f"rank {rank} is not on a mesh of {shape.world_size} ranks ({shape.sizes()})")
        self.coords: dict[str, int] = {}
        rest = rank
        for dim in reversed(DIMS):  # row-major: the last dimension varies fastest
            rest, self.coords[dim] = divmod(rest, getattr(shape, dim))
        self._device_mesh: DeviceMesh | None = None
        self._dp_mesh: DeviceMesh | None = None

    @property
    def dp_size(self) -> int:
        return self.shape.dp

    @property
    def dp_rank(self) -> int:
        """Which share of every global batch this rank trains on."""
        return self.coords["dp_replicate"] * self.shape.dp_shard + self.coords["dp_shard"]

    @property
    def tp_size(self) -> int:
        return self.shape.tp

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def ranks_per_replica(self) -> int:
        """Ranks that hold parts of one model replica and see the same samples (1 under pure data
        parallelism): a sum over all ranks counts each replica's samples and loss this many times."""
        return self.shape.tp

    def __getitem__(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh over ``dims``: a dimension's name, a tuple of names, or ``"dp"`` (both
        data-parallel dimensions as one)."""
        if dims == "dp":
            if self._dp_mesh is None:
                self._dp_mesh = self.device_mesh[DP]._flatten("dp")
            return self._dp_mesh
        return self.device_mesh[dims]

    @property
    def device_mesh(self) -> DeviceMesh:
        """The whole mesh, made on first use (a collective: every rank asks at the same point)."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh  # torch, which the config side leaves alone

            self._device_mesh = init_device_mesh(
                self.device_type, tuple(self.shape.sizes().values()), mesh_dim_names=DIMS
            )
        return self._device_mesh
