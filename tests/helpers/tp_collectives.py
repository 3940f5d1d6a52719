"""Counts the collectives one tensor-parallel training step issues, with DTensor's own
CommDebugMode, for each model config given; writes {model: {forward: {op: n}, backward: {...}}}.

    torchrun --standalone --nproc_per_node 2 tests/helpers/tp_collectives.py MODELS.json OUT.json
"""

import json
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from kan_models import build_model, parse_model_config
from strategies.backends.tp_plan import apply_tp
from strategies.runtime.distributed import DistEnv
from tests.helpers.dist_worker import finish


def counts(mode: CommDebugMode) -> dict[str, int]:
    # op names such as c10d_functional.all_gather_into_tensor -> all_gather, the projection's names
    return {str(op).split(".")[-1].removesuffix("_into_tensor"): n for op, n in mode.get_comm_counts().items()}


def main(models_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    env = DistEnv.from_environ("cpu")
    env.init_process_group(timeout_s=60)
    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("tp",))
    results = {}
    for name, config in json.loads(Path(models_path).read_text()).items():
        model = build_model(parse_model_config(config), seed=0)
        apply_tp(model, mesh, "pairs")
        x = torch.randn(16, config["widths"][0])
        with CommDebugMode() as forward:
            loss = model(x).pow(2).sum()
        with CommDebugMode() as backward:
            loss.backward()
        results[name] = {"forward": counts(forward), "backward": counts(backward)}
    finish(env, results, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
