"""Rehearse one strategy: its own ``apply`` and engine, at the target's world size and mesh, as one
of the target's ranks, with real tensors on this CPU and a fake process group (fake_world.py).

The collectives are counted on the step a run counts them on (its last warm-up step); the model
state, the tensor memory, FLOPs and kernels on a step after the first (DDP rebuilds its buckets
after the first, DeepSpeed makes its buffers in it, the optimizer its state)."""

from __future__ import annotations

import time
import warnings
from contextlib import nullcontext

import torch
from pydantic import ValidationError

from kanscale.errors import ConfigError
from strategies.experiment import ExperimentConfig
from strategies.lifecycle.preflight import Machines, preflight
from strategies.loop.loader import MemoryBatches
from strategies.loop.model_setup import build_rank_model, checkpoint_activations
from strategies.measure.comm_bytes import CollectiveBytes
from strategies.measure.kernels import KernelRecorder
from strategies.measure.tensor_memory import StepMemoryTracker, held_tensors, peak_memory
from strategies.native_training import with_native_training
from strategies.rehearsal.fake_world import answer_ddp_buckets, fake_world
from strategies.rehearsal.result import CollectiveCalls, Kernels, Refusal, Rehearsal
from strategies.runtime.batch_plan import BatchPlan
from strategies.runtime.distributed import DistEnv
from strategies.step.engine import Engine
from strategies.step.optim import launch_as_on_gpu
from strategies.step.schedule import innermost


def rehearse(cfg: ExperimentConfig, world_size: int, ranks_per_node: int, rank: int = 0) -> Rehearsal:
    """Rehearse ``cfg``'s strategy at ``world_size`` ranks, ``ranks_per_node`` to a node, as
    ``rank``. Raises ConfigError for what a launch at that layout would refuse before starting."""
    started = time.perf_counter()
    cfg = with_native_training(cfg)
    nodes = Machines(count=max(1, world_size // ranks_per_node), ranks_here=ranks_per_node, like_this_one=False)
    plan = preflight(cfg, "cpu", world_size, nodes, ranks_per_node)
    with fake_world(world_size, ranks_per_node, rank) as env:
        return measure_step(cfg, env, plan, started)


def measure_step(cfg: ExperimentConfig, env: DistEnv, plan: BatchPlan, started: float | None = None) -> Rehearsal:
    """This rank's step of ``cfg`` in the process group ``env`` is in, fake or real (a real one
    checks the fake one), measured as :func:`rehearse` reports it."""
    started = time.perf_counter() if started is None else started
    t = cfg.training
    env = env.on_mesh(cfg.strategy.mesh_shape(env.world_size, env.local_world_size))
    dtype = getattr(torch, t.dtype)
    data = cfg.task.generate(t.seed).to(env.device, dtype)
    model = build_rank_model(cfg, env, dtype)
    parameters = sum(p.numel() for p in model.parameters())
    checkpoint_activations(model, cfg)
    engine = cfg.strategy.apply(model, t, env)
    answer_ddp_buckets(engine.model)
    launch_as_on_gpu(innermost(engine.optimizer))  # the kernels counted are a GPU's
    batches = MemoryBatches(data.x_train, data.y_train, plan, t, env.mesh.dp_size, env.mesh.dp_rank)
    micro_batch = len(batches.batches(0)[0][0][0])
    comm_step = t.warmup_steps - 1 if t.warmup_steps else 1
    last = max(1, comm_step)
    comm = CollectiveBytes(env.local_world_size)
    for step in range(last):
        with comm if step == comm_step else nullcontext():
            _step(engine, batches, step, cfg)
    tracker, kernels = StepMemoryTracker(), KernelRecorder()
    tracker.track_external(held_tensors(engine.model), innermost(engine.optimizer))  # DeepSpeed's wraps torch's
    with tracker, comm if last == comm_step else nullcontext(), warnings.catch_warnings():
        # MemTracker reads .grad of FSDP1's parameter views, which autograd warns is never set
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        with kernels.phase_of_step("forward"):  # the batch's gather too: a GPU rank's data is on its device
            micro_batches, n_global = batches.batches(last)
            engine.forward_backward(micro_batches, cfg.task.loss_sum, n_global=n_global, count_state=True)
        with kernels.phase_of_step("optimizer"):
            engine.step(count_state=True)
    assert engine.counted_state is not None  # step(count_state=True) counted it
    return Rehearsal(
        strategy=cfg.strategy.label(),
        world_size=env.world_size,
        ranks_per_node=env.local_world_size,
        rank=env.rank,
        mesh=env.mesh.shape.sizes(),
        micro_batch=micro_batch,
        parameters=parameters,
        step=last + 1,
        model_state=engine.counted_state,
        memory=peak_memory(tracker, env.device),
        comm=comm.record(comm_step + 1) if env.world_size > 1 else None,
        collectives=[
            CollectiveCalls(
                kind=c.kind,
                group_ranks=c.ranks,
                link=c.link,
                elements=c.elements,
                dtype=c.dtype,
                calls=n,
                sent_bytes=c.sent * n,
            )
            for c, n in comm.calls.items()
        ],
        flops=sum(op.flops for op in kernels.ops),
        kernels=len(kernels.ops),
        ops=Kernels.grouped(kernels.ops),
        seconds=time.perf_counter() - started,
    )


def rehearse_or_refusal(
    cfg: ExperimentConfig, world_size: int, ranks_per_node: int, rank: int = 0
) -> Rehearsal | Refusal:
    """The rehearsal, or what refused it: the suite's own checks, or the backend at that layout
    (what a real launch would meet only once its ranks started)."""
    try:
        return rehearse(cfg, world_size, ranks_per_node, rank)
    except ValidationError:
        raise  # the rehearsal's own record: a bug here, not a refusal
    except ConfigError as e:
        reason = str(e)
    except (RuntimeError, ValueError, AssertionError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        reason = f"the backend refused this layout: {type(e).__name__}: {first[:300]}"
        if rank != 0:
            # A fake group delivers no rank's values to another: a backend that checks what rank 0
            # broadcast (ZeRO-3 compares list lengths) fails on every other rank, whatever the layout.
            reason = (
                f"could not be rehearsed as rank {rank} ({type(e).__name__}: {first[:200]}): backends that check "
                "values rank 0 broadcasts cannot be rehearsed as another rank; rehearse as rank 0"
            )
    return Refusal(strategy=cfg.strategy.label(), world_size=world_size, reason=reason)


def _step(engine: Engine, batches: MemoryBatches, step: int, cfg: ExperimentConfig) -> None:
    micro_batches, n_global = batches.batches(step)
    engine.forward_backward(micro_batches, cfg.task.loss_sum, n_global=n_global)
    engine.step()
