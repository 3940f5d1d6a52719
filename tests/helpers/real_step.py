"""Measures a rank's step as a rehearsal does (strategies/rehearsal/rehearse.py measure_step), but
inside a real process group started by torchrun: what the fake group's figures are checked
against. Writes rank 0's results, one per experiment, by the experiment's position.

    torchrun --standalone --nproc_per_node 2 tests/helpers/real_step.py EXPERIMENTS.json OUT.json
"""

import json
import sys
from pathlib import Path

from strategies.experiment import parse_experiment
from strategies.lifecycle.preflight import preflight
from strategies.native_training import with_native_training
from strategies.rehearsal.rehearse import measure_step
from strategies.runtime.distributed import DistEnv


def main(experiments: Path, out: Path) -> None:
    env = DistEnv.from_environ("cpu")
    env.init_process_group(300)
    results = []
    for data in json.loads(experiments.read_text()):
        cfg = with_native_training(parse_experiment(data))
        plan = preflight(cfg, "cpu", env.world_size)
        results.append(measure_step(cfg, env, plan).model_dump(mode="json"))
    if env.is_main:
        out.write_text(json.dumps(results))
    env.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
