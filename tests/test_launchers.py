"""Launch commands, SLURM scripts, hostfiles and the checks made before anything starts."""

import dataclasses
import subprocess
from pathlib import Path

import pytest

from kanscale.errors import ConfigError
from launchers.cli import main
from launchers.launch import run as run_module
from launchers.launch.commands import LaunchSpec, deepspeed_launch, torchrun_launch
from launchers.launch.hostfile import parse_hostfile
from launchers.launch.ports import free_port
from launchers.launch.request import RunRequest
from launchers.launch.run import plan
from launchers.launch.slurm import SlurmOptions, sbatch_script

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/experiments/quickstart.yaml")
PAPER = str(ROOT / "configs/experiments/paper_kan64.yaml")


def request(tmp_path, **spec) -> RunRequest:
    return RunRequest(config=QUICKSTART, out=str(tmp_path), strategy="ddp", spec=LaunchSpec(**spec))


def test_torchrun_single_node_and_multi_node():
    one = torchrun_launch(LaunchSpec(nproc_per_node=2), ["cfg.yaml"]).commands[0]
    assert one[1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",
        "-m",
        "launchers.cli",
        "train",
        "cfg.yaml",
    ]
    node1 = torchrun_launch(
        LaunchSpec(nproc_per_node=4, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400, rdzv_id="job7"),
        ["cfg.yaml"],
    ).commands[0]
    assert {
        "--nnodes=2",
        "--node_rank=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.0.0.1:29400",
        "--rdzv_id=job7",
        "--rdzv_conf=is_host=0",
    } <= set(node1)
    assert "--standalone" not in node1


def test_deepspeed_launcher_commands():
    launch = deepspeed_launch(LaunchSpec(launcher="deepspeed", nproc_per_node=2), ["cfg.yaml"])
    assert launch.env == {"DS_ACCELERATOR": "cpu"}
    assert "--num_gpus=2" in launch.commands[0] and launch.commands[0][-4:] == [
        "--module",
        "launchers.cli",
        "train",
        "cfg.yaml",
    ]
    multi = deepspeed_launch(
        LaunchSpec(launcher="deepspeed", hostfile="hosts", no_ssh=True, node_rank=1, device="cuda"), ["c"]
    )
    assert {"--hostfile=hosts", "--no_ssh", "--node_rank=1"} <= set(multi.commands[0]) and multi.env == {}


def test_accelerate_command_fills_in_the_sizes(tmp_path):
    _, _resolved, launch = plan(
        dataclasses.replace(request(tmp_path, launcher="accelerate", nproc_per_node=2), strategy="accelerate")
    )
    cmd = launch.commands[0]
    assert cmd[cmd.index("--config_file") + 1] == "configs/accelerate/ddp_cpu.yaml"
    assert {"--num_processes=2", "--num_machines=1", "--machine_rank=0"} <= set(cmd)


@pytest.mark.parametrize("inner", ["torchrun", "deepspeed", "accelerate"])
def test_sbatch_script_is_valid_bash_with_one_launcher_per_node(tmp_path, inner):
    spec = LaunchSpec(
        launcher="slurm", nproc_per_node=2, nnodes=4, device="cuda", accelerate_config="configs/accelerate/ddp.yaml"
    )
    text = sbatch_script(
        spec,
        SlurmOptions(inner=inner, time="01:00:00", partition="gpu"),
        ["cfg.yaml", "--out", "o"],
        job_name="kan",
        log_dir=str(tmp_path),
        cpus_per_task=4,
    )
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    for line in (
        "#SBATCH --job-name=kan",
        "#SBATCH --nodes=4",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --time=01:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=4",
        f"#SBATCH --output={tmp_path}/%x-%j.out",
        "export head_node=${nodes[0]}",
        "export KANSCALE_LAUNCHER=slurm",
        "export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}",
    ):
        assert line in text
    srun = next(line for line in text.splitlines() if line.startswith("srun"))
    assert srun.startswith("srun --kill-on-bad-exit=1 --nodes=4 --ntasks-per-node=1 --cpus-per-task=4 bash -c '")
    assert (
        "$SLURM_NODEID" in srun
        and "$head_addr" in srun
        and "$MASTER_PORT" in srun
        and "launchers.cli train cfg.yaml" in srun
    )
    if inner == "deepspeed":
        assert 'printf "%s slots=2\\n" "${nodes[@]}" > "$hostfile"' in text and "--no_ssh" in srun


def test_run_slurm_writes_the_script_and_explains_how_to_submit(tmp_path, capsys):
    code = main(
        [
            "run",
            PAPER,
            "--strategy",
            "zero3",
            "--launcher",
            "slurm",
            "--slurm-device",
            "cuda",
            "--nnodes",
            "4",
            "--nproc-per-node",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    (script,) = (tmp_path / "slurm").glob("*.sbatch")
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "sbatch" in capsys.readouterr().err


def test_dry_run_prints_commands_and_starts_nothing(tmp_path, capsys):
    assert (
        main(["run", QUICKSTART, "--strategy", "fsdp2", "--nproc-per-node", "2", "--out", str(tmp_path), "--dry-run"])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "torch.distributed.run --nproc_per_node=2 --standalone -m launchers.cli train" in out
        and "--strategy fsdp2" in out
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "lines,message",
    [
        ("node1 slots=2\nnode2 slotz=2\n", "DeepSpeed refuses it: Hostfile contains a bad entry: node2 slotz=2"),
        ("node0 slots = 2\n", "DeepSpeed refuses it: Hostfile contains a bad entry: node0 slots = 2"),
        ("node1 slots=2\nnode1 slots=2\n", "multiple entries for node1"),
        ("# only a comment\n", "Hostfile is empty"),
        ("node1 slots=0\n", "host node1 has slots=0; every node needs at least one"),
        ("node1 slots=1\nnode2 slots=2\n", "every host needs the same number of slots"),
    ],
)
def test_malformed_hostfiles(tmp_path, lines, message):
    path = tmp_path / "hostfile"
    path.write_text(lines)
    with pytest.raises(ConfigError, match="--hostfile") as err:
        parse_hostfile(path)
    assert message in str(err.value)


def test_hostfile_sets_nodes_and_ranks(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(
        "# DeepSpeed's format: comments on their own lines, anything after the slots ignored\n"
        "localhost slots=1 max_slots=1\n\n127.0.0.1 slots=1\n"
    )
    assert [(h.name, h.slots) for h in parse_hostfile(path)] == [("localhost", 1), ("127.0.0.1", 1)]
    # a free port: the default one may be a concurrent test's rendezvous, which planning refuses
    ask = request(tmp_path, launcher="deepspeed", hostfile=str(path), no_ssh=True, node_rank=1, master_port=free_port())
    _, resolved, launch = plan(dataclasses.replace(ask, given=frozenset({"master_port"})))
    assert (resolved.spec.nnodes, resolved.spec.nproc_per_node, resolved.spec.world_size) == (2, 1, 2)
    assert {f"--hostfile={path}", "--no_ssh", "--node_rank=1"} <= set(launch.commands[0])


def test_hosts_write_a_hostfile(tmp_path):
    # --no-ssh: every node is started by hand, so they are told where node 0 is (--master-addr)
    _, resolved, launch = plan(
        dataclasses.replace(
            request(tmp_path, launcher="deepspeed", no_ssh=True, master_addr="n1", master_port=free_port()),
            hosts=["n1", "n2"],
            given=frozenset({"master_addr", "master_port"}),
        )
    )
    assert launch.files == {tmp_path / "hostfile": "n1 slots=1\nn2 slots=1\n"}
    assert resolved.spec.world_size == 2


@pytest.mark.parametrize(
    "args,message",
    [
        (["--nproc-per-node", "64"], "--nproc-per-node: 64 rank(s) on this machine's"),
        (["--launcher", "none", "--nproc-per-node", "2"], "--launcher none starts one process"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank: 2 is not between 0 and --nnodes - 1 (1)"),
        (
            ["--hostfile", "/nonexistent/hosts", "--launcher", "deepspeed"],
            "--hostfile: /nonexistent/hosts does not exist",
        ),
        (["--hosts", "a,b", "--launcher", "torchrun"], "host lists are for the deepspeed launcher"),
        (["--set", "runtime.device=cuda"], "runtime.device: cuda was asked for but this machine has no CUDA device"),
    ],
)
def test_launches_that_cannot_work_are_refused_before_starting(tmp_path, capsys, args, message):
    assert main(["run", QUICKSTART, "--strategy", "ddp", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_a_launcher_that_is_not_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(run_module.LAUNCHER_PACKAGES, "deepspeed", "kanscale_no_such_package")
    with pytest.raises(ConfigError, match="--launcher deepspeed: kanscale_no_such_package is not installed"):
        plan(request(tmp_path, launcher="deepspeed"))
