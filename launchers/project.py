"""``kanscale project``: gather a compute profile and a network from the files given, run the
projection model (analysis/projection/) and write its tables. Every input problem is a
ConfigError naming the flag."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis import projection as pj
from analysis.projection.cluster_file import check_cluster
from analysis.report.documents import json_out, write_json_and_markdown
from kan_models import parse_model_config
from kanscale import log
from kanscale.errors import ConfigError
from kanscale.files import find_file, preset_names, read_json, read_mapping
from launchers.zoo import bench_model_config, model_shape
from strategies.experiment import load_strategy

logger = log.get(__name__)


@dataclass
class ProjectionRequest:
    profile: str  # run directory / directory of runs, a bench JSON, or "paper"
    network: list[str] | None  # commbench JSON files
    cluster: str | None  # or a cluster YAML
    ranks: str = "1,2,4,8"
    strategies: str | None = None
    row: str | None = None
    ranks_per_node: int | None = None
    micro_batch: float | None = None
    global_batch: float | None = None
    compute_scale: float = 1.0
    contention: float = 1.0
    forward_fraction: float | None = None
    probe: bool = False
    out: str | None = None


def checked(flag: str, load: Callable, *inputs: Any, **options: Any) -> Any:
    try:
        return load(*inputs, **options)
    except (ValueError, KeyError, OSError) as err:
        raise ConfigError(f"{flag}: {err}") from None


def network(request: ProjectionRequest) -> pj.Network:
    if request.cluster:
        path = find_file(request.cluster, "--cluster", "cluster file")
        doc = read_mapping(path, "--cluster")
        check_cluster(doc, path)  # every layout it projects comes from the file itself
        return checked("--cluster", pj.network_from_cluster, doc, str(path))
    files = request.network or []  # the command line asks for --cluster or --network
    docs = [read_json(p, "--network") for p in files]
    return checked("--network", pj.network_from_commbench, docs, ", ".join(files))


def profiles(request: ProjectionRequest) -> tuple[dict[str, pj.ComputeProfile], dict[str, Any]]:
    """Compute profiles by strategy ("*": any) and the model they were measured on."""
    if request.profile == "paper":
        profile, model = pj.paper_profile()
        found = {"*": profile}
    elif not Path(request.profile).exists():
        raise ConfigError(
            f"--profile: {request.profile} does not exist; give 1-rank run(s) of one experiment (a run "
            "directory or a directory of runs), a kanscale bench JSON, or paper"
        )
    elif Path(request.profile).is_file():
        doc = read_json(request.profile, "--profile")
        profile, workload, impl = checked("--profile", pj.profile_from_bench, doc, request.row)
        found, model = {"*": profile}, bench_model_config(doc, workload, impl)
    else:
        found, model = checked("--profile", pj.profiles_from_runs, request.profile)
    if request.forward_fraction is not None:
        if not 0 < request.forward_fraction < 1:
            raise ConfigError(f"--forward-fraction: a share between 0 and 1, e.g. 0.33; got {request.forward_fraction}")
        found = {
            k: dataclasses.replace(p, forward_fraction=request.forward_fraction, forward_source="given")
            for k, p in found.items()
        }
    return found, model


def cost_models(names: list[str] | None, model: dict[str, Any]) -> list[pj.StrategyModel]:
    """What each strategy issues per step, as its own class describes it (``cost_model``): the
    presets or preset files named, else every shipped preset the projection models (the
    one-process reference first). A named one without a model is refused, naming those with one."""
    config = parse_model_config(model)
    strategies = {name: load_strategy(name, config, "--strategies") for name in names or preset_names("strategies")}
    if names is None:  # the one-process reference first, the baseline every other row is read against
        strategies = dict(sorted(strategies.items(), key=lambda item: not item[1].reference))
    described = {name: strategy.cost_model() for name, strategy in strategies.items()}
    missing = [name for name, m in described.items() if m is None]
    if names and missing:
        modelled = [name for name in preset_names("strategies") if load_strategy(name, config).cost_model()]
        raise ConfigError(
            f"--strategies: the projection does not model {', '.join(missing)} (its options lead where "
            f"no cost model is written yet); presets it models: {', '.join(modelled)}"
        )
    return [m for m in described.values() if m is not None]


def run_projection(request: ProjectionRequest) -> int:
    if request.out:
        json_out(request.out)
    names = [s.strip() for s in request.strategies.split(",") if s.strip()] if request.strategies else None
    ranks = checked("--ranks", lambda: [int(r) for r in request.ranks.split(",") if r.strip()])
    if names == [] or not ranks or min(ranks) < 1:
        raise ConfigError(
            f"--strategies/--ranks: strategy presets (or preset files) and rank counts of at least 1, "
            f"e.g. --strategies ddp,zero3 --ranks 1,2,4,8; got {request.strategies} and {request.ranks}"
        )
    numbers = {
        "--micro-batch": request.micro_batch,
        "--global-batch": request.global_batch,
        "--ranks-per-node": request.ranks_per_node,
        "--compute-scale": request.compute_scale,
        "--contention": request.contention,
    }
    if any(value is not None and value <= 0 for value in numbers.values()):
        raise ConfigError(f"{', '.join(f for f, v in numbers.items() if v is not None and v <= 0)}: must be positive")
    net = network(request)
    found, model = profiles(request)
    # the model state follows the precision the profile was measured in (StrategyModel.casts_module)
    shape = dataclasses.replace(model_shape(model), precision=found["*"].precision)
    per_node = request.ranks_per_node or net.ranks_per_node
    strategies = cost_models(names, model)
    cut = [s.label for s in strategies if s.tp != 1]
    if cut and not shape.widths:
        if names:
            raise ConfigError(
                f"--strategies: {', '.join(cut)} cut layers that declare how (bspline, rbf, chebyshev); "
                f"the profile's model, {shape.label}, has none; leave them out"
            )
        strategies = [s for s in strategies if s.tp == 1]  # the default: every strategy that can run it
    options: dict[str, Any] = {
        "micro_batch": request.micro_batch,
        "global_batch": request.global_batch,
        "compute_scale": request.compute_scale,
        "contention": request.contention,
        "probe": request.probe,
    }
    rows = checked(
        "--cluster" if request.cluster else "--network",
        pj.project,
        strategies,
        shape,
        found,
        net,
        ranks,
        per_node,
        **options,
    )
    takeovers = {
        s.label: pj.takeover(s, shape, found.get(s.label) or found["*"], net, per_node, **options)
        for s in strategies
        if s.multi_rank
    }
    notes = pj.assumptions(shape, found, net, request.compute_scale, request.contention, request.probe)
    text = pj.markdown(rows, notes, takeovers, pj.search_limit(net, per_node))
    print(text)
    if request.out:
        twin = write_json_and_markdown(request.out, pj.document(rows, notes, takeovers), text)
        logger.info(f"wrote {request.out} and {twin}")
    return 0
