"""What each rank holds under each strategy, and whether exposed communication is measured
right. Two real ranks on gloo."""

import pytest

from tests.helpers.launch import run_jobs

MEMORY_STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp1": {"name": "fsdp1"},
    "fsdp2": {"name": "fsdp2"},
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
}
DELAY_S = 0.03


def experiment(strategy: dict, widths: list[int], steps: int, out: str) -> dict:
    return {
        "name": "sharding",
        "model": {"family": "bspline", "widths": widths, "grid": 10, "grid_range": [-2.0, 2.0]},
        "task": {"name": "quadratic", "n_train": 4096, "n_test": 128},
        "training": {"seed": 0, "micro_batch": 64, "steps": steps, "warmup_steps": 2},
        "strategy": strategy,
        "measurement": {"baseline_steps": 5},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": out},
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharding")
    out = str(tmp / "runs")
    jobs = [{"id": key, "config": experiment(s, [2, 64, 64, 1], 3, out)} for key, s in MEMORY_STRATEGIES.items()]
    jobs += [
        {"id": "ddp_plain", "config": experiment({"name": "ddp"}, [2, 8, 1], 25, out)},
        {"id": "ddp_delayed", "config": experiment({"name": "ddp"}, [2, 8, 1], 25, out), "comm_delay_s": DELAY_S},
    ]
    probed = experiment({"name": "ddp"}, [2, 8, 1], 25, out)
    jobs.append(
        {"id": "ddp_paper_probe", "config": {**probed, "measurement": {"baseline_steps": 5, "comm_probe": "paper"}}}
    )
    return run_jobs(jobs, tmp)


def ratio(results, strategy, field):
    return results[strategy]["model_state"][field] / results["ddp"]["model_state"][field]


@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2", "zero3"])
def test_full_sharding_holds_half_the_parameters(results, strategy):
    assert ratio(results, strategy, "params") == pytest.approx(0.5, abs=0.03)
    assert ratio(results, strategy, "grads") == pytest.approx(0.5, abs=0.03)
    assert ratio(results, strategy, "optimizer") == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_1_and_2_hold_half_the_optimizer_state_but_all_parameters(results, strategy):
    assert ratio(results, strategy, "optimizer") == pytest.approx(0.5, abs=0.03)
    assert ratio(results, strategy, "params") == pytest.approx(1.0, abs=0.03)
    # ZeRO keeps an fp32 master copy of its parameter partition even when training in fp32
    assert results[strategy]["model_state"]["master_params"] / results["ddp"]["model_state"]["params"] == pytest.approx(
        0.5, abs=0.03
    )


def test_ddp_holds_everything(results):
    state = results["ddp"]["model_state"]
    assert state["params"] == state["grads"] > 0 and state["optimizer"] >= 2 * state["params"]
    assert state["master_params"] == 0


def test_injected_communication_delay_is_measured_by_both_methods(results):
    plain, delayed = results["ddp_plain"], results["ddp_delayed"]
    added = delayed["comm"]["replica"]["median_s"] - plain["comm"]["replica"]["median_s"]
    added_check = delayed["comm"]["check"]["median_s"] - plain["comm"]["check"]["median_s"]
    print(f"injected {DELAY_S * 1e3:.1f} ms/step: measured +{added * 1e3:.1f} ms, check +{added_check * 1e3:.1f} ms")
    # Bounds wider than two runs' noise on a shared machine: the delay is measured once, neither
    # lost nor counted twice.
    assert DELAY_S / 2 < added < 2 * DELAY_S
    assert DELAY_S / 2 < added_check < 2 * DELAY_S
    # the compute-only baseline does not see the communication delay
    assert delayed["timings"]["compute_s"] < DELAY_S
    for run in (plain, delayed):
        comm = run["comm"]
        trusted = comm[comm["trusted"]]["median_s"]
        assert run["timings"]["comm_exposed_s"] == trusted
        assert run["comm_overhead"] == pytest.approx(trusted / run["timings"]["step_mean_s"])
        assert comm["replica"]["low_s"] <= comm["replica"]["median_s"] <= comm["replica"]["high_s"]


def test_the_paper_probe_reports_its_number_and_changes_the_training(results):
    plain, probed = results["ddp_plain"], results["ddp_paper_probe"]
    assert plain["measurement"]["paper_probe_overhead"] is None
    assert 0 < probed["measurement"]["paper_probe_overhead"] < 1
    # the first probe (step 2) doubles step 2's gradients: identical losses up to step 2, different after
    assert probed["losses"][:2] == plain["losses"][:2]
    assert all(a != b for a, b in zip(probed["losses"][2:], plain["losses"][2:], strict=True))
