"""Hand-made run records with known numbers, for testing the analysis."""

from pathlib import Path

from analysis.records.run_files import RunWriter
from analysis.records.schema import (
    BatchInfo,
    CommExposure,
    CompileInfo,
    Environment,
    MeasurementInfo,
    Memory,
    ModelInfo,
    ModelStateBytes,
    PrecisionInfo,
    RunRecord,
    Spread,
    StrategyInfo,
    TaskInfo,
    Throughput,
    Timings,
    Topology,
)


def make_record(
    run_id: str,
    *,
    study: str = "strong",
    strategy: str = "ddp",
    world: int = 1,
    nodes: int = 1,
    samples_per_s: float = 1000.0,
    comm: float = 0.1,
    family: str = "bspline",
    widths=(2, 8, 1),
    params: int = 100,
    peak_rss: int = 10_000,
    state=(400, 400, 800, 0),
    final_loss: float = 0.5,
    micro_batch: int = 64,
    grid: int = 5,
    order: int = 3,
    options: dict | None = None,
    backend_config: dict | None = None,
    label: str | None = None,
    window: tuple[float, float] | None = None,
    comm_agree: bool | None = None,
    threads: int | None = None,
    cpus: int | None = None,
    precision: str = "fp32",
) -> RunRecord:
    """``window``: the (slowest, fastest) timing window's samples/s; ``comm_agree``: whether the
    two exposed-communication methods agreed (None: there was one)."""
    step = 0.01
    return RunRecord(
        run_id=run_id,
        name="hand",
        status="ok",
        study=study,
        config_digest="d" * 16,
        started_at="2026-11-30T00:00:00+00:00",
        finished_at="2026-11-30T00:01:00+00:00",
        seed=0,
        strategy=StrategyInfo(
            name=strategy,
            label=label or strategy,
            reference=strategy == "single",
            options=options or {},
            backend_config=backend_config,
        ),
        model=ModelInfo(
            family=family,
            widths=list(widths),
            grid=grid,
            order=order,
            options={},
            params_trainable=params,
            params_total=params,
        ),
        task=TaskInfo(name="quadratic", input_dim=2, n_train=1000, n_test=100),
        topology=Topology(
            world_size=world,
            nodes=nodes,
            procs_per_node=world // nodes,
            launcher="torchrun",
            comm_backend="gloo" if world > 1 else None,
            device_type="cpu",
            device_name="test CPU",
            threads_per_rank=threads,
        ),
        batch=BatchInfo(
            micro_batch=micro_batch,
            grad_accum=1,
            global_batch=micro_batch * world,
            steps=10,
            epochs=1.0,
            warmup_steps=2,
            timed_steps=8,
        ),
        timings=Timings(
            total_s=1.0,
            step_mean_s=step,
            step_p50_s=step,
            step_p95_s=step,
            data_s=0.0,
            compute_s=step * (1 - comm),
            comm_exposed_s=step * comm,
        ),
        throughput=Throughput(
            samples_per_s=samples_per_s,
            samples_per_s_per_rank=samples_per_s / world,
            samples_per_s_low=window[0] if window else None,
            samples_per_s_high=window[1] if window else None,
        ),
        comm_overhead=comm,
        comm=CommExposure(
            replica=Spread(median_s=step * comm, low_s=step * comm, high_s=step * comm),
            check=None if comm_agree is None else Spread(median_s=0.0, low_s=0.0, high_s=0.0),
            agree=comm_agree,
            trusted="replica",
            note="hand-made",
        ),
        measurement=MeasurementInfo(comm_method="test", baseline_steps=1, window_steps=4, windows=2),
        memory=Memory(
            peak_rss_bytes=peak_rss,
            model_state=ModelStateBytes(params=state[0], grads=state[1], optimizer=state[2], master_params=state[3]),
        ),
        final_loss=final_loss,
        test_metrics={"mse": final_loss},
        environment=Environment(python="3", torch="2", platform="test", hosts=["h"], cpu_count=cpus),
        precision=PrecisionInfo(setting=precision, mechanism="hand-made"),
        compile=CompileInfo(setting="none", mechanism="eager"),
    )


def write_record(directory: Path, record: RunRecord) -> Path:
    writer = RunWriter(directory / record.run_id)
    writer.write_summary(record)
    return writer.run_dir
