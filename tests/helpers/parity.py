"""The parity experiments several test files share: one model per family, the strategies under
test, and the comparison of a strategy's per-step losses with the one-process reference."""

from tests.helpers.launch import run_here

STEPS = 20
FAMILIES = {
    "bspline": {"family": "bspline", "widths": [2, 8, 1], "grid": 5, "grid_range": [-2.0, 2.0]},
    "pykan": {"family": "pykan", "widths": [2, 4, 1], "grid": 5},
}
STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp1": {"name": "fsdp1"},
    "fsdp1_grad_op": {"name": "fsdp1", "sharding_strategy": "SHARD_GRAD_OP"},
    "fsdp1_no_shard": {"name": "fsdp1", "sharding_strategy": "NO_SHARD"},
    "fsdp2": {"name": "fsdp2"},
    "fsdp2_keep": {"name": "fsdp2", "reshard_after_forward": False},
    "zero0": {"name": "deepspeed", "zero_stage": 0},
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
    "zero3_offload": {"name": "deepspeed", "zero_stage": 3, "offload_optimizer": True},
    "accelerate": {"name": "accelerate"},
}


def experiment(family: str, strategy: dict, accum: int, out: str, **training) -> dict:
    return {
        "name": f"parity_{family}",
        "model": FAMILIES[family],
        "task": {"name": "quadratic", "n_train": 640, "n_test": 128},
        "training": {
            "seed": 3,
            "lr": 1e-2,
            "micro_batch": None,
            "global_batch": 64,
            "grad_accum": accum,
            "steps": STEPS,
            "warmup_steps": 2,
            **training,
        },
        "strategy": strategy,
        "measurement": {"baseline_steps": 1},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": out},
    }


def single_losses(cfg: dict) -> list[float]:
    """The per-step losses of ``cfg`` trained in this process, as the single strategy."""
    return [s.loss for s in run_here({**cfg, "strategy": {"name": "single"}}).combined]


def max_rel_diff(a: list[float], b: list[float], steps: int = STEPS) -> float:
    assert len(a) == len(b) == steps
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
