"""Reading records of earlier schema versions: each is migrated to the current one on read.
Files on disk are never rewritten.

v1 -> v2: ``test_mse`` became the named ``test_metrics`` ({"mse": ...}); the strategy gained
its ``label`` (the one vocabulary of presets, tables and projections) and ``reference`` (the
one-process run every strategy is compared with). A v1 record did not store a label, so it is
rebuilt here from what v1 stored, the way v1's analysis named runs, in today's words. This is the
one place outside the strategy modules that knows strategies by name: v1's frozen meaning.

v2 -> v3: exposed communication gained its spread and its check as one ``comm`` section, and
``comm_exposed_s`` became signed. A v2 record timed its compute baseline once, before training,
with a barrier around every step, and clamped the difference at 0: its ``comm`` says so, and its
one number stands for the whole run (no spread over windows).

v3 -> v4: the record says its ``precision`` and its batch its ``loader``. Every v3 run computed
in full precision from in-memory batches, which is what its migration says.

v4 -> v5: the record says what ``training.compile`` compiled. v4 could compile only the model
(``model.compile``), and recorded a compile time exactly when it did.

v5 -> v6: the record says which compute baseline ran (``measurement.baseline``: every v5 run had
the whole replica, the default) and what other processes took of the machine
(``measurement.outside_load``: v5 did not measure it, so None) and where torch.compile broke
its graphs (``compile.graph_breaks``: not counted, None); exposed communication may be
None (a baseline switched off, or no method read a time). A v5 record keeps its raw figures.

v6 -> v7: the record counts one step's tensors by category and its FLOPs (``memory.step_peak``,
``memory.activations_after_forward_bytes``, ``flops``) and says how activations were
checkpointed. v6 counted none of them, so they are None: not measured, not zero.
"""

from __future__ import annotations

import copy
from typing import Any

from analysis.records.schema import SCHEMA_VERSION

READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, SCHEMA_VERSION)
V2_COMM_NOTE = (
    "recorded by schema v2: compute timed once before training on a replica, with a barrier around every "
    "step; the difference was clamped at 0, so 0 may stand for a negative one"
)
_FSDP1_LABELS = {
    "FULL_SHARD": "fsdp1",
    "SHARD_GRAD_OP": "fsdp1_grad_op",
    "NO_SHARD": "fsdp1_no_shard",
    "HYBRID_SHARD": "fsdp1_hybrid",
}


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """A record of any readable version as a current one (a new dict)."""
    version = data.get("schema_version")
    if version == SCHEMA_VERSION:
        return data
    later = [_v1_to_v2, _v2_to_v3, _v3_to_v4, _v4_to_v5, _v5_to_v6, _v6_to_v7]
    steps = {v: later[v - 1 :] for v in (1, 2, 3, 4, 5, 6)}
    if version in steps:
        for step in steps[version]:
            data = step(data)
        return data
    raise ValueError(f"schema_version {version!r} is not one this kanscale reads (it reads {list(READABLE_VERSIONS)})")


def _v1_to_v2(v1: dict[str, Any]) -> dict[str, Any]:
    record = copy.deepcopy(v1)
    record["schema_version"] = 2
    mse = record.pop("test_mse", None)
    record["test_metrics"] = None if mse is None else {"mse": mse}
    strategy = record.get("strategy") or {}
    strategy["label"] = _v1_label(strategy)
    strategy["reference"] = strategy.get("name") == "single"
    return record


def _v2_to_v3(v2: dict[str, Any]) -> dict[str, Any]:
    record = copy.deepcopy(v2)
    record["schema_version"] = 3
    timings, measurement = record.get("timings"), record.get("measurement")
    if timings is None or measurement is None:  # a run that never finished
        return record
    check = timings.pop("comm_exposed_check_s", None)
    record["comm"] = {
        "replica": _one_value(timings["comm_exposed_s"]),
        "check": None if check is None else _one_value(check),
        "difference_s": None if check is None else timings["comm_exposed_s"] - check,
        "trusted": "replica",
        "note": V2_COMM_NOTE,
    }
    measurement.update(timing="per_step", window_steps=1, windows=(record.get("batch") or {}).get("timed_steps", 0))
    return record


def _v3_to_v4(v3: dict[str, Any]) -> dict[str, Any]:
    record = copy.deepcopy(v3)
    record["schema_version"] = 4
    record["precision"] = {"setting": "fp32", "mechanism": "none (schema v3 ran in full precision)"}
    if isinstance(record.get("batch"), dict):
        record["batch"].update(loader="memory", loader_workers=0)
    return record


def _v4_to_v5(v4: dict[str, Any]) -> dict[str, Any]:
    record = copy.deepcopy(v4)
    record["schema_version"] = 5
    compiled = (record.get("timings") or {}).get("compile_s") is not None
    record["compile"] = (
        {"setting": "model", "mechanism": "torch.compile(model) (schema v4)"}
        if compiled
        else {"setting": "none", "mechanism": "eager (schema v4)"}
    )
    return record


def _v5_to_v6(v5: dict[str, Any]) -> dict[str, Any]:
    record = copy.deepcopy(v5)
    record["schema_version"] = 6
    if isinstance(record.get("measurement"), dict):
        record["measurement"]["baseline"] = "replica"
    return record


def _v6_to_v7(v6: dict[str, Any]) -> dict[str, Any]:
    record = copy.deepcopy(v6)
    record["schema_version"] = 7  # the new fields' defaults (None) say: not counted
    return record


def _one_value(seconds: float) -> dict[str, float]:
    return {"median_s": seconds, "low_s": seconds, "high_s": seconds}


def _v1_label(strategy: dict[str, Any]) -> str:
    name, options = strategy.get("name", "?"), strategy.get("options") or {}
    zero = (strategy.get("backend_config") or {}).get("zero_optimization")
    if zero is not None:  # DeepSpeed, directly or under Accelerate: v1 recorded the stage only here
        offloaded = any(
            (zero.get(k) or {}).get("device", "none") != "none" for k in ("offload_optimizer", "offload_param")
        )
        label = f"zero{zero.get('stage', 0)}" + ("_offload" if offloaded else "")
        return label if name == "deepspeed" else f"accelerate_{label}"
    if name == "fsdp1":
        return _FSDP1_LABELS.get(options.get("sharding_strategy", "FULL_SHARD"), "fsdp1")
    if name == "fsdp2":
        return "fsdp2" if options.get("reshard_after_forward", True) else "fsdp2_keep"
    if name == "accelerate":
        kind = (strategy.get("distributed_type") or "").upper()
        return {
            "MULTI_CPU": "accelerate_ddp",
            "MULTI_GPU": "accelerate_ddp",
            "NO": "accelerate_single",
            "FSDP": "accelerate_fsdp",
        }.get(kind, "accelerate")
    return name
