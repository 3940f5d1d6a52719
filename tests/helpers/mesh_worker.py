"""Places every rank on run meshes of the shapes given and writes, per shape and rank, where the
suite's arithmetic puts the rank (strategies/runtime/mesh.py) beside where torch's DeviceMesh does.

    torchrun --standalone --nproc_per_node 4 tests/helpers/mesh_worker.py SHAPES.json OUT.json
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from strategies.runtime.distributed import DistEnv
from strategies.runtime.mesh import DIMS, MeshShape
from tests.helpers.dist_worker import finish


def place(env: DistEnv, shape: MeshShape) -> dict:
    mesh = env.on_mesh(shape).mesh
    return {
        "coords": mesh.coords,
        "dp_rank": mesh.dp_rank,
        "dp_size": mesh.dp_size,
        "tp_rank": mesh.tp_rank,
        "torch_coords": {dim: mesh.device_mesh.get_local_rank(dim) for dim in DIMS},
        "torch_dp": [mesh["dp"].get_local_rank(), mesh["dp"].size()],
        "groups": {dim: dist.get_process_group_ranks(mesh[dim].get_group()) for dim in DIMS},
    }


def main(shapes_path: str, out_path: str) -> None:
    env = DistEnv.from_environ("cpu")
    env.init_process_group(timeout_s=60)
    results = {}
    for name, sizes in json.loads(Path(shapes_path).read_text()).items():
        placed = env.gather_strings(json.dumps(place(env, MeshShape(**sizes))))
        results[name] = [json.loads(p) for p in placed]
    finish(env, results, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
