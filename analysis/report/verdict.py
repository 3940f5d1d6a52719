"""The answer at the top of the report: for each scale measured (one model on one task in one
study), which strategy is fastest, which needs the least memory per rank, which did not fit or
does not scale, each with its numbers and spread, and the caveats that apply.

Rules, so that a verdict is never stronger than its evidence:

- Runs are repeats of one point only when their experiments are equal but for the seed (their
  config.yaml); a strategy that ran different experiments at one world size has one point per
  experiment, named by what differs.
- A point's interval is the min-max of its repeated runs; a point run once has the spread of its
  rate over the run's timing windows instead (the caption says which).
- Strategies are ranked by median throughput, but those whose intervals overlap, directly or
  through another's, share a rank ("=1"), and so on down: the legend's rule, with no exception.
- Runs of different global batches (a weak-scaling study's, or another experiment's) are ranked
  together only with a caveat naming each batch and who ran it.
- A strategy "does not scale" when its best interval at more than one rank lies wholly below the
  one-process run's.
- Peak memory differences under MEMORY_NOISE of the peak are a tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import pandas as pd

from analysis.report.format import human_bytes
from analysis.report.tables import count, fixed, hardware, percent
from kanscale.identity import differences, dotted

SCALE = ["study", "model_label", "task_label"]
POINT = ["strategy_label", "world_size", "topology_label"]
MEMORY_NOISE = 0.02  # allocator and page-granularity noise of resident memory, as a share of the peak
OVERHEAD_CAVEAT = 0.5  # exposed communication above this share of the step: the step is mostly overhead
STATE_CAVEAT = 0.01  # model state below this share of peak memory: sharding it barely moves the peak
# Other processes busier than this many cores during the timed steps: the machine was shared. A quiet
# machine's kernel threads and daemons stay well below it (docs/metrics.md, outside load).
OUTSIDE_CAVEAT = 0.15
MEMORY_ERRORS = ("outofmemory", "out of memory", "memoryerror", "does not fit", "cannot allocate")


@dataclass
class ScaleVerdict:
    title: str
    findings: list[tuple[str, str]]  # (what, the answer with its evidence)
    caveats: list[str]
    points: pd.DataFrame  # one row per strategy and world size, numbers
    table: pd.DataFrame  # the same, as text
    spread: str  # what the intervals are


@dataclass
class Verdict:
    scales: list[ScaleVerdict] = field(default_factory=list)

    @property
    def data(self) -> pd.DataFrame:
        """Every scale's points in one table (for CSV)."""
        return pd.concat([s.points.assign(scale=s.title) for s in self.scales], ignore_index=True)

    def markdown(self) -> str:
        parts = ["## Verdict\n"]
        for s in self.scales:
            parts.append(f"### {s.title}\n")
            parts += [f"- **{what}**: {text}" for what, text in s.findings]
            parts += [f"- *Caveat*: {c}" for c in s.caveats]
            parts.append(f"\n{s.table.to_markdown(index=False, disable_numparse=True)}\n\n{s.spread}\n")
        return "\n".join(parts)


def interval(runs: pd.DataFrame) -> tuple[float, float, str]:
    """A point's throughput interval and what it is (see the module docstring)."""
    if len(runs) > 1:
        return runs["samples_per_s"].min(), runs["samples_per_s"].max(), "repeats"
    return runs["samples_per_s_low"].iloc[0], runs["samples_per_s_high"].iloc[0], "windows"


def point_names(runs: pd.DataFrame) -> dict[tuple, str]:
    """The name in the verdict of each point (``POINT`` and repeat identity): the strategy's
    label, and where one strategy at one world size and topology ran several different
    experiments, what differs, so that they are separate points and never pooled as repeats
    (``single (training.global_batch=64)``)."""
    names = {}
    for group, at in runs.groupby(POINT):
        point = cast(tuple, group)  # grouped by a list of columns: each key is a tuple
        configs = at.drop_duplicates("repeat_key").set_index("repeat_key")["repeat_config"]
        differ = sorted({key for other in configs for key in differences(configs.iloc[0], other)})
        for key, config in configs.items():
            flat = dotted(config)
            point_key = (*point, key)
            names[point_key] = point[0] + (f" ({', '.join(f'{k}={flat.get(k)}' for k in differ)})" if differ else "")
    return names


def points(runs: pd.DataFrame) -> pd.DataFrame:
    if "repeat_key" not in runs:  # runs not read by load_runs: known by their config digest
        runs = runs.assign(
            repeat_key=runs["config_digest"], repeat_config=pd.Series([{}] * len(runs), index=runs.index)
        )
    rows = []
    names = point_names(runs)
    for point, at in runs.groupby([*POINT, "repeat_key"]):
        _, world, topology, _ = point
        low, high, kind = interval(at)
        rows.append(
            {
                "strategy": names[point],
                "world_size": world,
                "topology": topology,
                "global_batch": at["batch.global_batch"].iloc[0],
                "runs": len(at),
                "samples_per_s": at["samples_per_s"].median(),
                "low": low,
                "high": high,
                "interval": kind,
                "speedup": at["speedup"].median(),
                "baseline": at["baseline"].iloc[0],
                "comm_overhead": at["comm_overhead"].median(),
                "comm_agree": at["comm_agree"].iloc[0],
                "comm_trusted": at["comm_trusted"].iloc[0],
                "compute_ms": at["compute_ms"].median(),
                "step_ms": at["step_ms"].median(),
                "peak_memory_bytes": at["peak_memory_bytes"].median(),
                "peak_memory_kind": at["peak_memory_kind"].iloc[0],
                "model_state_bytes": at["model_state_bytes"].median(),
                "activations_bytes": at["activations_bytes"].median(),
                "activations_share": at["activations_share"].median(),
                "reference": bool(at["strategy.reference"].iloc[0]),
                "core_load": at["core_load"].max(),
                "outside_cores": at["outside_cores"].max(),
                "precision": at["precision.setting"].iloc[0],
                "workers": at["batch.loader_workers"].iloc[0],
                "threads": at["topology.threads_per_rank"].iloc[0] if "topology.threads_per_rank" in at else None,
                "cores": at["environment.cpu_count"].iloc[0] if "environment.cpu_count" in at else None,
            }
        )
    table = pd.DataFrame(rows).sort_values("samples_per_s", ascending=False).reset_index(drop=True)
    table["rank"] = tie_ranks(table)
    return table


def tie_ranks(table: pd.DataFrame) -> list[str]:
    """Rank labels by median throughput (``table`` sorted fastest first): a point whose interval
    overlaps the interval of any point of the group above it joins that group; a group of more
    than one point shares its rank, shown as ``=N``."""
    groups: list[list[int]] = []
    lowest = float("inf")  # the lowest interval end of the group being built
    for i, (_, row) in enumerate(table.iterrows()):
        if groups and row["high"] >= lowest:
            groups[-1].append(i)
            lowest = min(lowest, row["low"])
        else:
            groups.append([i])
            lowest = row["low"]
    labels = [""] * len(table)
    for rank, group in enumerate(groups, start=1):
        for i in group:
            labels[i] = f"={rank}" if len(group) > 1 else str(rank)
    return labels


def rate(row: pd.Series) -> str:
    return f"{count(row['samples_per_s'])} samples/s [{count(row['low'])}-{count(row['high'])}]"


def where(row: pd.Series) -> str:
    return f"{row['strategy']} at {row['world_size']} rank{'s' if row['world_size'] > 1 else ''}"


def fastest(table: pd.DataFrame) -> str:
    tied = table[table["rank"].isin(["1", "=1"])]
    if len(tied) == 1:
        best, runner = table.iloc[0], table.iloc[1] if len(table) > 1 else None
        ahead = f", ahead of {where(runner)} ({rate(runner)})" if runner is not None else ""
        return f"{where(best)}, {rate(best)}{ahead}"
    return (
        "a tie, the intervals overlap: "
        + "; ".join(f"{where(r)} {rate(r)}" for _, r in tied.iterrows())
        + " (run more repeats or longer to separate them)"
    )


def least_memory(table: pd.DataFrame) -> str:
    kind = "device memory" if table["peak_memory_kind"].iloc[0] == "device" else "resident memory (RSS)"
    lowest = table["peak_memory_bytes"].min()
    tied = table[table["peak_memory_bytes"] <= lowest * (1 + MEMORY_NOISE)].sort_values("peak_memory_bytes")
    names = ", ".join(f"{where(r)} ({human_bytes(r['peak_memory_bytes'])})" for _, r in tied.iterrows())
    peak = f"least peak {kind} per rank: {names}" + (
        f" (within {MEMORY_NOISE:.0%} of each other: a tie)" if len(tied) > 1 else ""
    )
    state = table.sort_values("model_state_bytes").iloc[0]
    most = table["model_state_bytes"].max()
    return (
        f"{peak}; least model state per rank: {where(state)}, {human_bytes(state['model_state_bytes'])} "
        f"(the most: {human_bytes(most)})"
    )


def not_scaling(table: pd.DataFrame) -> str | None:
    """Each strategy against the one-process run of its own precision (a study may sweep it)."""
    references = table[table["reference"] & (table["world_size"] == 1)]
    if references.empty:
        return None
    several = references["precision"].nunique() > 1
    slower = []
    for (_, precision), rows in table[table["world_size"] > 1].groupby(["strategy", "precision"]):
        own = references[references["precision"] == precision]
        if own.empty:
            continue
        best, one = rows.sort_values("samples_per_s").iloc[-1], own.iloc[0]
        if best["high"] < one["low"]:
            slower.append(f"{where(best)} ({rate(best)})" + (f" against {where(one)} ({rate(one)})" if several else ""))
    one = references.iloc[0]
    if not slower:
        within = "of its precision " if several else f"({rate(one)}) "
        return f"none: every strategy at more than one rank reaches the one-process rate {within}within its spread"
    return (
        "slower than one process of the same precision: " if several else f"slower than one process ({rate(one)}): "
    ) + "; ".join(slower)


def unfinished(runs: pd.DataFrame) -> str | None:
    if runs.empty:
        return None
    lines = []
    for _, run in runs.iterrows():
        message = str(run.get("error.message") or "no error recorded")
        kind = (
            "does not fit"
            if any(e in (message + str(run.get("error.type"))).lower() for e in MEMORY_ERRORS)
            else run["status"]
        )
        lines.append(
            f"{run['strategy_label']} at {run['topology.world_size']} ranks: {kind} "
            f"({run.get('error.type') or run['status']}: {message[:160]})"
        )
    return "; ".join(lines)


def caveats(table: pd.DataFrame) -> list[str]:
    notes = []
    distributed = table[table["world_size"] > 1]
    heavy = distributed[distributed["comm_overhead"] > OVERHEAD_CAVEAT]
    if not heavy.empty:
        low, high = percent(heavy["comm_overhead"].min()), percent(heavy["comm_overhead"].max())
        notes.append(
            f"communication and backend overhead are {low if low == high else f'{low}-{high}'} of a step for "
            f"{', '.join(heavy['strategy'])} (compute "
            f"{fixed(2)(heavy['compute_ms'].median())} ms per rank): at this size a step is mostly overhead, so "
            "the ranking says how each backend's overhead compares, not how it trains a larger model"
        )
    share = (table["model_state_bytes"] / table["peak_memory_bytes"]).max()
    if share < STATE_CAVEAT:
        notes.append(
            f"model state is at most {share:.3%} of peak memory: the peak is the interpreter, libraries, data "
            "and activations, so sharding model state barely moves it at this size"
        )
    loaded = table[table["world_size"] > 1].sort_values("core_load")
    if not loaded.empty and loaded["core_load"].iloc[-1] >= 1:
        row = loaded.iloc[-1]
        ranks = f"{row['world_size'] // int(row['topology'].split('x')[0])} ranks x {row['threads']:.0f} thread(s)"
        ranks += f" and {row['workers']:.0f} DataLoader worker(s) each" if row["workers"] else ""
        notes.append(
            f"{ranks} per machine on its {row['cores']:.0f} core(s): "
            + (
                "more threads than cores, so the ranks took turns on the cores"
                if row["core_load"] > 1
                else "the ranks took every core, so communication threads and everything else on the machine competed "
                "with them"
            )
            + "; a speedup near the rank count was not possible here, and the ranking may differ on "
            "machines with a core (or a GPU) to spare per rank"
        )
    shared = table[table["outside_cores"] > OUTSIDE_CAVEAT].sort_values("outside_cores", ascending=False)
    if not shared.empty:
        worst = shared.iloc[0]
        of = f" of its {worst['cores']:.0f}" if pd.notna(worst["cores"]) else ""
        notes.append(
            f"the machine was shared: other processes kept up to {worst['outside_cores']:.2f} core(s){of} busy while "
            f"{', '.join(shared['strategy'])} {'was' if len(shared) == 1 else 'were'} timed (measured from "
            "/proc/stat against the runs' own CPU time), so those rates are lower than on a quiet machine and the "
            "ranking may differ there; rerun them when it is idle"
        )
    differ = table[table["comm_agree"].eq(False)]
    if not differ.empty:
        notes.append(
            "the two exposed-communication methods disagree beyond noise for "
            + ", ".join(f"{r['strategy']} (trust the {r['comm_trusted']})" for _, r in differ.iterrows())
            + "; the comm column uses the trusted one, and docs/metrics.md explains both"
        )
    singles = table[table["reference"] & (table["world_size"] == 1)].set_index("precision")
    for low in ("bf16", "fp16"):
        if low in singles.index and "fp32" in singles.index:
            ratio = singles.loc[low, "samples_per_s"] / singles.loc["fp32", "samples_per_s"]
            if singles.loc[low, "high"] < singles.loc["fp32", "low"]:
                notes.append(
                    f"{low} is slower than fp32 here ({ratio:.2f}x in one process, the intervals apart): on this "
                    f"machine and model its casts and kernels cost more than they save; the ranking of "
                    "precisions may differ on GPUs, whose low-precision arithmetic is several times faster"
                )
    batches = table.groupby("global_batch")["strategy"].unique()
    if len(batches) > 1:
        who = "; ".join(
            f"{count(cast(float, batch))} ({', '.join(sorted(set(names)))})" for batch, names in batches.items()
        )
        notes.append(
            f"these runs trained {len(batches)} different global batches, ranked together here: {who}. A larger "
            "batch moves more samples per step for the same communication, so part of a difference in rate is "
            "the batch's, not the strategy's; compare within one batch (a strong-scaling study keeps it fixed)"
        )
    if (table["runs"] == 1).all():
        notes.append(
            "each point ran once: intervals are the spread of its rate over its timing windows, not over "
            "repeats (set `repeats: N` in the study for that)"
        )
    return notes


def text_table(table: pd.DataFrame) -> pd.DataFrame:
    def comm(row: pd.Series) -> str:
        if row["world_size"] == 1:  # no communication: what the figure measures is overhead beyond compute
            measured = "not measured" if pd.isna(row["comm_overhead"]) else percent(row["comm_overhead"])
            return f"{measured} beyond compute (1 process: no comm)"
        if pd.isna(row["comm_overhead"]):
            return "not measured"
        methods = {True: "methods agree", False: f"methods differ: {row['comm_trusted']}"}.get(
            row["comm_agree"], "one method"
        )
        return f"{percent(row['comm_overhead'])} ({methods})"

    return pd.DataFrame(
        {
            "rank": table["rank"],
            "strategy": table["strategy"],
            "nodes x ranks": table["topology"],
            "samples/s [interval]": table.apply(
                lambda r: f"{count(r['samples_per_s'])} [{count(r['low'])}-{count(r['high'])}]", axis=1
            ),
            "speedup vs 1 process": table["speedup"].map(lambda v: "" if pd.isna(v) else fixed(2)(v)),
            "exposed comm": table.apply(comm, axis=1),
            "peak memory / rank": table["peak_memory_bytes"].map(human_bytes),
            "model state / rank (share of peak)": table.apply(
                lambda r: (
                    f"{human_bytes(r['model_state_bytes'])} ({r['model_state_bytes'] / r['peak_memory_bytes']:.2%})"
                ),
                axis=1,
            ),
            "activations / rank (share of step peak)": table.apply(
                lambda r: (
                    "not counted"
                    if pd.isna(r["activations_bytes"])
                    else f"{human_bytes(r['activations_bytes'])} ({percent(r['activations_share'])})"
                ),
                axis=1,
            ),
        }
    )


def verdict(derived: pd.DataFrame, unfinished_runs: pd.DataFrame | None = None) -> Verdict:
    """The verdict for every scale with at least one finished run (``derived``); failed or
    incomplete runs of a scale (``unfinished_runs``, rows of load_runs) are named in it."""
    result = Verdict()
    failed = unfinished_runs if unfinished_runs is not None else pd.DataFrame(columns=SCALE)
    if not failed.empty:
        failed = failed.assign(study=failed["study"].fillna("(none)"))
    scales = sorted(derived.groupby(SCALE), key=lambda group: group[1]["model.params_trainable"].iloc[0])
    for (study, model, task), runs in scales:
        table = points(runs)
        params = runs["model.params_trainable"].iloc[0]
        others = failed[(failed["study"] == study) & (failed["model_label"] == model) & (failed["task_label"] == task)]
        findings = [("Fastest", fastest(table)), ("Least memory", least_memory(table))]
        for what, text in (("Does not scale", not_scaling(table)), ("Did not finish", unfinished(others))):
            if text is not None:
                findings.append((what, text))
        kinds = set(table["interval"])
        spread = (
            "Intervals: "
            + {
                "repeats": "min-max over repeated runs",
                "windows": "min-max of the rate over the run's timing windows",
            }.get(kinds.pop(), "")
            if len(kinds) == 1
            else "Intervals: min-max over repeated runs where a point was repeated, else over its timing windows"
        )
        result.scales.append(
            ScaleVerdict(
                title=f"{model} ({count(params)} parameters) on {task}, study `{study}`: {hardware(runs)}",
                findings=findings,
                caveats=caveats(table),
                points=table,
                table=text_table(table),
                spread=spread
                + "; strategies whose intervals overlap, directly or through another's, share a rank (=N).",
            )
        )
    return result
