"""The published study's numbers next to this suite's runs of the same configuration, what to run
where there are none, and what the study's own communication probe costs."""

from __future__ import annotations

import statistics
from pathlib import Path

import pandas as pd

from analysis.records.load import Problem
from analysis.records.run_files import STEPS_FILE, RecordError, read_steps
from analysis.report.tables import Table, count, fixed, general, hardware, percent
from kanscale.files import configs_dir

PAPER_CSV = Path(__file__).parent / "reference" / "paper_results.csv"
CONFIGURATION = "pykan [2, W, 1], grid 10, k 3, x^2 + y^2, batch 512 per rank"
PAPER_HARDWARE = "published: NVIDIA A100, 2 per node, InfiniBand, DDP over NCCL"
DIFFERENCES = (
    "The published rows ran on NVIDIA A100 GPUs (2 per node, InfiniBand between nodes) with DDP over NCCL for 40 "
    "epochs of the study's sample counts; kanscale's rows ran where their hardware column says, usually with fewer "
    "samples and epochs, so throughput and final loss compare only within a source, while speedup and efficiency "
    "compare the shape of scaling. Communication overhead differs in kind: the study's probe timed an extra "
    "all-reduce added every second batch (which also changed the gradients), kanscale's is the exposed "
    "communication of the unmodified training step."
)


def paper_results() -> pd.DataFrame:
    """The published rows; where the paper gives no efficiency (weak scaling), the per-GPU
    throughput retention against its own 1-GPU run is derived, as for kanscale's runs."""
    paper = pd.read_csv(PAPER_CSV)
    one_gpu = paper[paper["gpus"] == 1].set_index(["study", "hidden_width"])["throughput_per_gpu_sps"]
    baseline = paper.set_index(["study", "hidden_width"]).index.map(one_gpu.get)
    retention = 100 * paper["throughput_per_gpu_sps"] / pd.Series(baseline, index=paper.index, dtype=float)
    paper["parallel_efficiency_pct"] = paper["parallel_efficiency_pct"].fillna(retention)
    return paper


def study_configuration(derived: pd.DataFrame) -> pd.DataFrame:
    """Runs of the published configuration: pykan [2, W, 1], grid 10, k 3, the study's task,
    512 samples per rank per step."""
    widths = derived["model.widths"].map(lambda w: list(w) if isinstance(w, (list, tuple)) else [])
    same = (
        (derived["model.family"] == "pykan")
        & widths.map(lambda w: len(w) == 3 and w[0] == 2 and w[2] == 1)
        & (derived["model.grid"] == 10)
        & (derived["model.order"] == 3)
        & (derived["task.name"] == "quadratic")
        & (derived["batch.micro_batch"] == 512)
        & (derived["batch.grad_accum"] == 1)
    )
    runs = derived[same].copy()
    runs["hidden_width"] = widths[same].map(lambda w: w[1])
    return runs


def paper_comparison(derived: pd.DataFrame) -> Table:
    paper = paper_results()
    paper_rows = pd.DataFrame(
        {
            "study": paper["study"],
            "topology": paper["nodes"].astype(str) + "x" + paper["gpus_per_node"].astype(str),
            "hidden_width": paper["hidden_width"],
            "source": "published (DDP)",
            "hardware": PAPER_HARDWARE,
            "samples_per_s": paper["throughput_total_sps"],
            "samples_per_s_per_rank": paper["throughput_per_gpu_sps"],
            "speedup": paper["speedup"],
            "efficiency": paper["parallel_efficiency_pct"] / 100,
            "comm_overhead": paper["comm_overhead_pct"] / 100,
            "final_loss": paper["final_loss"],
            "world_size": paper["gpus"],
        }
    )
    ours = study_configuration(derived)
    ours = ours[ours["study"].isin(paper_rows["study"].unique())]
    our_rows = pd.DataFrame(
        {
            "study": ours["study"],
            "topology": ours["topology_label"],
            "hidden_width": ours["hidden_width"],
            "source": "kanscale " + ours["strategy_label"],
            "hardware": [hardware(ours.loc[[i]]) for i in ours.index],
            "samples_per_s": ours["samples_per_s"],
            "samples_per_s_per_rank": ours["samples_per_s_per_rank"],
            "speedup": ours["speedup"],
            "efficiency": ours["efficiency"],
            "comm_overhead": ours["comm_overhead"],
            "final_loss": ours["final_loss"],
            "world_size": ours["world_size"],
        }
    )
    keys = ["study", "world_size", "topology", "hidden_width", "source", "hardware"]
    our_rows = our_rows.groupby(keys, as_index=False).median(numeric_only=True) if not our_rows.empty else our_rows
    data = pd.concat([paper_rows, our_rows], ignore_index=True)
    order = {"strong": 0, "weak": 1, "comm": 2, "model_size": 3}
    data = data.sort_values(
        ["study", "hidden_width", "world_size", "topology", "source"],
        key=lambda c: c.map(order) if c.name == "study" else c,
    ).reset_index(drop=True)
    formats = {
        "samples_per_s": count,
        "samples_per_s_per_rank": count,
        "speedup": fixed(2),
        "efficiency": percent,
        "comm_overhead": percent,
        "final_loss": general,
    }
    text = data[["study", "topology", "hidden_width", "source", "hardware"]].rename(
        columns={"topology": "nodes x ranks", "hidden_width": "W"}
    )
    headers = {
        "samples_per_s": "samples/s",
        "samples_per_s_per_rank": "samples/s per rank",
        "speedup": "speedup",
        "efficiency": "efficiency",
        "comm_overhead": "comm overhead",
        "final_loss": "final loss",
    }
    for key, fmt in formats.items():
        text[headers[key]] = data[key].map(lambda v, fmt=fmt: "" if pd.isna(v) else fmt(v))
    matched = len(our_rows)
    missing = [
        s
        for s in sorted(paper_rows["study"].unique(), key=lambda study: order[study])
        if s not in set(our_rows["study"])
    ]
    caption = (
        f"{what_is_missing(missing, matched)}The published study ({CONFIGURATION}) beside {matched} kanscale point(s) "
        f"of the same configuration. {DIFFERENCES}"
    )
    return Table("paper", caption, data, text)


def what_is_missing(studies: list[str], matched: int) -> str:
    """For published studies no run here matches: say so, and the sweeps that would run them."""
    if not studies:
        return ""
    commands = "; ".join(populate_commands(study) for study in studies)
    if matched == 0:
        return (
            f"None of these runs matches the published configuration ({CONFIGURATION}, in a study named "
            f"{', '.join(studies)}), so only the published rows are shown. To run it: {commands}. "
        )
    studies_named = f"{', '.join(studies)} stud{'y' if len(studies) == 1 else 'ies'}"
    return f"No run here matches the published {studies_named}: {commands}. "


def populate_commands(study: str) -> str:
    """The shipped sweeps of the published configuration for ``study`` (``<study>_cpu.yaml`` for
    this machine, ``<study>_paper.yaml`` for a SLURM GPU cluster), as commands to type."""
    found = []
    for suffix, where, flags in (("cpu", "here", ""), ("paper", "on a SLURM GPU cluster", " --submit")):
        name = f"{study}_{suffix}.yaml"
        if (configs_dir() / "studies" / name).is_file():
            found.append(f"`kanscale sweep configs/studies/{name} --out runs/{study}{flags}` ({where})")
    if not found:
        return f"no shipped study runs the published {study} configuration"
    return f"{' or '.join(found)}, then `kanscale analyze runs/{study}`"


def probe_costs(derived: pd.DataFrame, problems: list[Problem] | None = None) -> Table | None:
    """What the study's probe costs, measured inside each run that ran it with more than one
    rank: it fires on every second step, so the median time of probed steps minus that of the
    others is its cost, free of the drift between runs. Spread over all steps, that cost lowers
    the per-rank throughput by 1 - 1 / (1 + cost / 2 / unprobed step). A run whose steps cannot
    be read, or hold no timed probed and unprobed steps, is left out, and added to ``problems``."""
    runs = (
        derived[(derived["measurement.comm_probe"] == "paper") & (derived["world_size"] > 1)]
        if "measurement.comm_probe" in derived
        else derived.iloc[0:0]
    )
    problems = [] if problems is None else problems
    rows = []
    for _, run in runs.iterrows():
        steps_file = Path(run["run_dir"]) / STEPS_FILE
        try:
            steps = [s for s in read_steps(steps_file) if s.timed]
        except RecordError as err:
            problems.append(Problem(steps_file, f"{err}; its probe cost is left out"))
            continue
        probed = [s.time_s_max for s in steps if s.step % 2 == 0]
        plain = [s.time_s_max for s in steps if s.step % 2 == 1]
        if not probed or not plain:
            problems.append(
                Problem(steps_file, f"{steps_file}: no timed probed and unprobed steps; its probe cost is left out")
            )
            continue
        probed_s, plain_s = statistics.median(probed), statistics.median(plain)
        share = (probed_s - plain_s) / 2 / plain_s
        rows.append(
            {
                "run_id": run["run_id"],
                "study": run["study"],
                "ranks": run["world_size"],
                "probed_step_ms": 1e3 * probed_s,
                "unprobed_step_ms": 1e3 * plain_s,
                "probe_share": share,
                "throughput_loss": 1 - 1 / (1 + share),
                "study_number": run["measurement.paper_probe_overhead"],
            }
        )
    if not rows:
        return None
    data = pd.DataFrame(rows)
    text = pd.DataFrame(
        {
            "run": data["run_id"],
            "study": data["study"],
            "ranks": data["ranks"],
            "probed step ms": data["probed_step_ms"].map(fixed(1)),
            "other steps ms": data["unprobed_step_ms"].map(fixed(1)),
            "probe adds per step (average)": data["probe_share"].map(percent),
            "per-rank throughput lost to the probe": data["throughput_loss"].map(percent),
            "the study's number (t2-t1)/t2": data["study_number"].map(percent),
        }
    )
    caption = (
        "The study's probe measured inside runs that ran it (measurement.comm_probe=paper): probed steps against the "
        f"other steps of the same run. Published for comparison: the per-GPU throughput fell by {published_drop():.1%} "
        "from 1 to 2 GPUs in one node."
    )
    return Table("paper_probe", caption, data, text)


def published_drop() -> float:
    """1 - per-GPU throughput at 2 GPUs in one node / at 1 GPU, strong scaling, as published."""
    strong = paper_results().query("study == 'strong' and nodes == 1").set_index("gpus")["throughput_per_gpu_sps"]
    return 1 - strong[2] / strong[1]
