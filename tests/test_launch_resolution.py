"""What `kanscale run` launches is what the user asked: ports, the accelerate launch config's own
values, sbatch scripts for the cluster they run on, the ssh path's requirements, and sweeps that
submit. Each check runs the real CLI (dry runs and script writing start nothing)."""

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from launchers.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/experiments/quickstart.yaml")


def dry_run(capsys, *args: str) -> str:
    assert main(["run", QUICKSTART, "--dry-run", *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def refused(capsys, *args: str, command: str = "run") -> str:
    assert main([command, *([QUICKSTART] if command == "run" else []), *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def option(text: str, name: str) -> str:
    """The value of ``--name=VALUE`` in a printed command."""
    return next(word.split("=", 1)[1] for word in text.split() if word.startswith(f"--{name}="))


def accelerate_yaml(tmp_path: Path, **settings) -> str:
    base = yaml.safe_load((ROOT / "configs/accelerate/ddp_cpu.yaml").read_text())
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump({**base, **settings}))
    return str(path)


# ports --------------------------------------------------------------------------------------


def test_a_free_port_where_every_rank_starts_here(capsys, monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    ports = {
        option(
            dry_run(capsys, "--strategy", "zero2", "--launcher", "deepspeed", "--nproc-per-node", "2"), "master_port"
        )
        for _ in range(3)
    }
    assert "29500" not in ports and len(ports) > 1  # the OS's free ports, not one fixed number


def test_master_port_from_the_environment_and_the_option(capsys, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29611")
    accelerate = dry_run(capsys, "--strategy", "accelerate", "--nproc-per-node", "2")
    assert option(accelerate, "main_process_port") == "29611"
    assert (
        option(
            dry_run(capsys, "--strategy", "zero2", "--launcher", "deepspeed", "--master-port", "29612"), "master_port"
        )
        == "29612"
    )
    monkeypatch.setenv("MASTER_PORT", "http")
    assert "MASTER_PORT='http' in the environment is not a port number" in refused(
        capsys, "--strategy", "ddp", "--dry-run"
    )


def test_a_port_in_use_is_refused_with_the_fix(capsys):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        err = refused(capsys, "--strategy", "zero2", "--launcher", "deepspeed", "--master-port", port, "--dry-run")
    assert f"--master-port: port {port} (--master-port) is already in use on this machine" in err
    assert "pass a free --master-port" in err


# the accelerate launch config's own values ---------------------------------------------------


def test_the_accelerate_config_sizes_the_launch_unless_the_command_line_does(tmp_path, capsys):
    config = accelerate_yaml(tmp_path, num_processes=2, num_machines=1)
    assert option(dry_run(capsys, "--strategy", "accelerate", "--accelerate-config", config), "num_processes") == "2"
    err = refused(
        capsys, "--strategy", "accelerate", "--accelerate-config", config, "--nproc-per-node", "1", "--dry-run"
    )
    assert "--nproc-per-node 1 but num_processes: 2 over num_machines: 1 is 2 per node" in err
    assert "drop the option to use the file's value, or change the file" in err


def test_a_multi_machine_template_keeps_its_rank_address_and_port(tmp_path, capsys):
    config = accelerate_yaml(
        tmp_path, num_processes=2, num_machines=2, machine_rank=1, main_process_ip="10.1.2.3", main_process_port=29777
    )
    cmd = dry_run(capsys, "--strategy", "accelerate", "--accelerate-config", config)
    assert [
        option(cmd, k)
        for k in ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port")
    ] == ["2", "2", "1", "10.1.2.3", "29777"]
    assert "--node-rank 0 but machine_rank: 1" in refused(
        capsys, "--strategy", "accelerate", "--accelerate-config", config, "--node-rank", "0", "--dry-run"
    )


# sbatch scripts ---------------------------------------------------------------------------


def write_script(tmp_path: Path, capsys, *args: str, out: str | None = None) -> str:
    out = out or str(tmp_path / "out")
    assert main(["run", QUICKSTART, "--launcher", "slurm", "--out", out, *args]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    script = Path(next(line.split(" ", 1)[1] for line in err.splitlines() if line.startswith("wrote ")))
    subprocess.run(["bash", "-n", str(script)], check=True)
    return script.read_text()


@pytest.mark.parametrize("inner", ["torchrun", "deepspeed", "accelerate"])
def test_a_cpu_cluster_gets_no_gpu_request_and_a_core_per_rank_and_thread(tmp_path, capsys, inner):
    strategy = {"torchrun": "ddp", "deepspeed": "zero2", "accelerate": "accelerate"}[inner]
    text = write_script(
        tmp_path,
        capsys,
        "--strategy",
        strategy,
        "--inner-launcher",
        inner,
        "--slurm-device",
        "cpu",
        "--nproc-per-node",
        "2",
        "--set",
        "runtime.threads=3",
    )
    assert "--gpus-per-node" not in text and "#SBATCH --cpus-per-task=6" in text
    assert "--cpus-per-task=6 bash -c" in text
    if inner == "deepspeed":
        assert "export DS_ACCELERATOR=cpu" in text
    if inner == "accelerate":  # the default accelerate config, found without --accelerate-config
        assert "configs/accelerate/ddp_cpu.yaml" in text


def test_a_gpu_cluster_gets_gpus(tmp_path, capsys):
    text = write_script(tmp_path, capsys, "--strategy", "ddp", "--slurm-device", "cuda", "--nproc-per-node", "4")
    assert "#SBATCH --gpus-per-node=4" in text and "DS_ACCELERATOR" not in text


def test_auto_without_a_cluster_to_ask_says_what_to_pass(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo here
    err = refused(capsys, "--strategy", "ddp", "--launcher", "slurm", "--out", str(tmp_path))
    assert (
        "--slurm-device: auto asks the cluster whether its nodes have GPUs" in err
        and "--slurm-device cuda or cpu" in err
    )


def test_script_paths_are_absolute_and_names_carry_the_strategy(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ddp = write_script(tmp_path, capsys, "--strategy", "ddp", "--slurm-device", "cpu", out="relative")
    zero2 = write_script(tmp_path, capsys, "--strategy", "zero2", "--slurm-device", "cpu", out="relative")
    assert f"#SBATCH --output={tmp_path}/relative/slurm/%x-%j.out" in ddp
    assert f"--out {tmp_path}/relative" in ddp and f"launchers.cli train {QUICKSTART}" in ddp
    assert len(list((tmp_path / "relative/slurm").glob("*.sbatch"))) == 2  # one per strategy, none overwritten
    assert (
        "#SBATCH --job-name=kanscale-quickstart-ddp" in ddp and "#SBATCH --job-name=kanscale-quickstart-zero2" in zero2
    )


def test_the_head_node_is_reached_at_the_address_slurm_uses(tmp_path, capsys):
    text = write_script(tmp_path, capsys, "--strategy", "ddp", "--slurm-device", "cpu", "--nnodes", "2")
    assert 'scontrol show node "$head_node"' in text and "NodeAddr" in text
    assert '"--rdzv_endpoint=$head_addr:$MASTER_PORT"' in text


def test_accelerate_checks_hold_under_slurm(tmp_path, capsys):
    err = refused(
        capsys,
        "--strategy",
        "accelerate",
        "--launcher",
        "slurm",
        "--inner-launcher",
        "accelerate",
        "--slurm-device",
        "cpu",
        "--accelerate-config",
        str(ROOT / "configs/accelerate/fsdp2.yaml"),
        "--nproc-per-node",
        "2",
        "--out",
        str(tmp_path),
    )
    assert "Accelerate's FSDP plugin does not run on CPUs" in err
    assert not (tmp_path / "slurm").exists()


def test_submit_without_slurm_is_refused(tmp_path, capsys):
    err = refused(capsys, "--strategy", "ddp", "--submit", "--out", str(tmp_path))
    assert "--submit: only a SLURM launch is submitted" in err


# sweeps that submit -----------------------------------------------------------------------


def test_sweep_submit_on_a_local_study_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "runs"
    err = refused(capsys, str(ROOT / "configs/studies/demo_cpu.yaml"), "--out", str(out), "--submit", command="sweep")
    assert "--submit:" in err and "has launcher: torchrun" in err and "set launcher: slurm in the study" in err
    err = refused(capsys, str(ROOT / "configs/studies/demo_cpu.yaml"), "--out", str(out), "--wait", command="sweep")
    assert "--wait follows the SLURM jobs a sweep submits; add --submit" in err
    assert not out.exists()


# the deepspeed ssh path -------------------------------------------------------------------


def test_missing_pdsh_is_named_before_launch(tmp_path, capsys, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if shutil.which("ssh"):
        os.symlink(shutil.which("ssh"), bin_dir / "ssh")
    monkeypatch.setenv("PATH", str(bin_dir))
    err = refused(
        capsys,
        "--strategy",
        "zero2",
        "--launcher",
        "deepspeed",
        "--hosts",
        "localhost,127.0.0.1",
        "--out",
        str(tmp_path / "out"),
        "--dry-run",
    )
    assert "started over ssh with pdsh, which is not installed here" in err and "--no-ssh --node-rank R" in err


def test_ssh_options_need_the_ssh_path(capsys):
    err = refused(capsys, "--strategy", "ddp", "--ssh-port", "2222", "--dry-run")
    assert "--ssh-port/--ssh-key: ssh starts the nodes only with --launcher deepspeed and a hostfile" in err


def test_the_remote_ranks_env_file_carries_what_they_need_and_nothing_a_shell_would_run(monkeypatch):
    from kanscale.errors import ConfigError
    from launchers.launch.ssh import deepspeed_env_text

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    text = deepspeed_env_text("cpu")
    assert "DS_ACCELERATOR=cpu\n" in text and "OMP_NUM_THREADS=1\n" in text
    for hostile in ("$(touch PWNED)", "`id`", 'a"b', "x\ny"):
        monkeypatch.setenv("KANSCALE_NOTE", hostile)
        with pytest.raises(ConfigError, match="KANSCALE_NOTE: its value holds"):
            deepspeed_env_text("cpu")
