"""Security at the shell: no value a user passes is run by a shell, and host names are host names.
What a user's files may hold (pickles, alias bombs) is tests/test_untrusted_files.py.

The shell tests execute what kanscale prints and writes, with real bash: the Python that would
start the ranks is replaced by a program that records its arguments, and SLURM's srun and
scontrol by small scripts that do what the job script needs of them (tests/cluster runs the
real SLURM). A hostile value passes if nothing it holds ran and it arrives as one argument.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kanscale.errors import ConfigError
from launchers.cli import main
from launchers.launch.commands import LaunchSpec, deepspeed_launch
from launchers.launch.hostfile import check_host_name

ROOT = Path(__file__).resolve().parents[1]
VALID = ROOT / "tests/bad_inputs/valid_experiment.yaml"

# Each would run `touch PWNED` (or change the argument) if a shell read it unquoted.
HOSTILE = {
    "substitution": "$(touch PWNED)",
    "backticks": "`touch PWNED`",
    "semicolon": "x; touch PWNED",
    "and": "x && touch PWNED",
    "pipe": "x | touch PWNED",
    "quotes": 'it\'s "$(touch PWNED)"',
    "single_quoted": "'$(touch PWNED)'",
    "line_break": "x\n$(touch PWNED)",
    "variables": "$HOME ${PATH}",
    "backslashes": "\\$(touch PWNED)\\",
    "comment": "#$(touch PWNED)",
}

ARGV_RECORDER = """#!/usr/bin/env bash
# stands in for the Python that starts the ranks: records its arguments, NUL-separated
printf '%s\\0' "$@" > "$ARGV_DIR/$(date +%s%N)-$$"
"""
SRUN = """#!/usr/bin/env bash
# stands in for srun: runs the step's command once per node, with that node's SLURM_NODEID
nodes=1
while [[ $1 == --* ]]; do [[ $1 == --nodes=* ]] && nodes=${1#--nodes=}; shift; done
for ((i = 0; i < nodes; i++)); do SLURM_NODEID=$i "$@" || exit; done
"""
SCONTROL = """#!/usr/bin/env bash
# stands in for scontrol: the job's nodes node0, node1, ... at 10.0.0.1, 10.0.0.2, ...
case "$1 $2" in
  "show hostnames") echo node0; echo node1 ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=10.0.0.$((${3#node} + 1)) NodeHostName=$3" ;;
esac
"""
JOB_ID = 4242
JOB_PORT = 20000 + JOB_ID % 20000  # the script's port without --master-port (launchers.launch.slurm)


@pytest.fixture
def shell(tmp_path, monkeypatch):
    """A stub bin directory and an empty working directory; returns a function that runs a
    script with bash there and returns the argument lists the stand-in Python recorded."""
    bin_dir, argv_dir, cwd = tmp_path / "bin", tmp_path / "argv", tmp_path / "cwd"
    for folder in (bin_dir, argv_dir, cwd):
        folder.mkdir()
    for name, text in (("python", ARGV_RECORDER), ("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.chdir(cwd)
    assert shlex.quote(sys.executable) == sys.executable  # replaced below as plain text

    def run(text: str, **env: str) -> list[list[str]]:
        script = tmp_path / "under_test.sh"
        script.write_text(text.replace(sys.executable, str(bin_dir / "python")))
        subprocess.run(["bash", "-n", str(script)], check=True)
        done = subprocess.run(
            ["bash", str(script)],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "ARGV_DIR": str(argv_dir), **env},
        )
        assert done.returncode == 0, done.stderr
        assert_nothing_ran(tmp_path)
        return [f.read_bytes().decode().split("\0")[:-1] for f in sorted(argv_dir.iterdir())]

    return run


def assert_nothing_ran(tmp_path: Path) -> None:
    made = list(tmp_path.rglob("PWNED")) + [
        p for p in (ROOT / "PWNED", Path(tempfile.gettempdir()) / "PWNED") if p.exists()
    ]
    assert made == [], f"a hostile value ran: {made}"


def hostile_paths(tmp_path: Path, value: str) -> tuple[Path, Path]:
    """An experiment file in a directory named with ``value``, and an output directory named with it."""
    folder = tmp_path / f"cfg-{value}"
    folder.mkdir()
    shutil.copy(VALID, folder / "exp.yaml")
    return folder / "exp.yaml", tmp_path / f"out-{value}"


LAUNCHES = {
    "none": ["--launcher", "none"],
    "torchrun": ["--launcher", "torchrun", "--nproc-per-node", "2", "--oversubscribe"],
    "accelerate": ["--launcher", "accelerate", "--nproc-per-node", "2", "--oversubscribe"],
    "deepspeed": ["--launcher", "deepspeed", "--nproc-per-node", "2", "--oversubscribe"],
    "deepspeed_hosts": ["--launcher", "deepspeed", "--hosts", "localhost,127.0.0.1", "--no-ssh"],
}


@pytest.mark.parametrize("launcher", LAUNCHES)
@pytest.mark.parametrize("name", HOSTILE)
def test_a_dry_run_runs_exactly_the_command_it_shows(shell, tmp_path, capsys, launcher, name):
    value = HOSTILE[name]
    config, out = hostile_paths(tmp_path, value)
    assert (
        main(["run", str(config), *LAUNCHES[launcher], "--set", f"study={value}", "--out", str(out), "--dry-run"]) == 0
    )
    (argv,) = shell(capsys.readouterr().out)
    for expected in (f"study={value}", str(config), str(out)):
        assert expected in argv  # intact, as one argument


# what each inner launcher gets from the job script's own variables on node R
NODE_ARGS = {
    "torchrun": lambda r: {f"--node_rank={r}", f"--rdzv_endpoint=10.0.0.1:{JOB_PORT}", f"--rdzv_id={JOB_ID}"},
    "deepspeed": lambda r: {f"--node_rank={r}", "--master_addr=10.0.0.1", f"--master_port={JOB_PORT}"},
    "accelerate": lambda r: {f"--machine_rank={r}", "--main_process_ip=10.0.0.1", f"--main_process_port={JOB_PORT}"},
}


@pytest.mark.parametrize("inner", NODE_ARGS)
@pytest.mark.parametrize("name", HOSTILE)
def test_an_sbatch_script_expands_only_its_own_variables(shell, tmp_path, inner, name):
    value = HOSTILE[name]
    config, out = hostile_paths(tmp_path, value)
    out = out.with_name(out.name.replace("\n", " "))  # a line break in --out is refused under SLURM (below)
    assert (
        main(
            [
                "run",
                str(config),
                "--launcher",
                "slurm",
                "--slurm-device",
                "cpu",
                "--inner-launcher",
                inner,
                "--nnodes",
                "2",
                "--set",
                f"study={value}",
                "--partition",
                value.replace("\n", " "),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (script,) = (out / "slurm").glob("*.sbatch")
    records = shell(script.read_text(), SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_ID=str(JOB_ID))
    assert len(records) == 2  # one launcher per node
    for argv in records:
        rank = 0 if "--node_rank=0" in argv or "--machine_rank=0" in argv else 1
        assert NODE_ARGS[inner](rank) <= set(argv)
        assert {f"study={value}", str(config), str(out)} <= set(argv)
    if inner == "deepspeed":
        hostfile = out / "slurm" / f"hostfile-{JOB_ID}"
        assert f"--hostfile={hostfile}" in records[0] and hostfile.read_text() == "node0 slots=1\nnode1 slots=1\n"


def sbatch_arguments(line: str) -> list[str]:
    """The arguments sbatch reads from one #SBATCH line: sbatch's _get_argument (src/sbatch/opt.c)
    in Python. White space splits outside quotes, a backslash escapes, # starts a comment."""
    text, i, found = line.removeprefix("#SBATCH"), 0, []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        chars, quote, escaped = [], None, False
        while i < len(text) and (quote or not text[i].isspace()):
            c, i = text[i], i + 1
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
                continue
            elif quote:
                if c == quote:
                    quote = None
                    continue
            elif c in "\"'":
                quote = c
                continue
            elif c == "#":
                i = len(text)
                break
            chars.append(c)
        assert quote is None, f"sbatch: unmatched {quote} in {line!r}"
        if not chars:
            return found
        found.append("".join(chars))


@pytest.mark.parametrize("name", [n for n in HOSTILE if n != "line_break"])
def test_sbatch_reads_each_directive_as_the_one_value_given(in_tmp_cwd, name):
    value = HOSTILE[name]
    out = in_tmp_cwd / f"out-{value}%j"
    assert (
        main(
            [
                "run",
                str(VALID),
                "--launcher",
                "slurm",
                "--slurm-device",
                "cpu",
                "--nnodes",
                "2",
                "--partition",
                value,
                "--account",
                value,
                "--time",
                value,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (script,) = (out / "slurm").glob("*.sbatch")
    options = [
        arg for line in script.read_text().splitlines() if line.startswith("#SBATCH") for arg in sbatch_arguments(line)
    ]
    # %% is SLURM's escape for a literal % in a file name pattern
    for expected in (
        f"--partition={value}",
        f"--account={value}",
        f"--time={value}",
        f"--output={str(out).replace('%', '%%')}/slurm/%x-%j.out",
    ):
        assert expected in options
    assert len(options) == 8  # job name, nodes, tasks, cores, output, time, partition, account: nothing split off


def test_the_ssh_path_refuses_what_deepspeeds_pdsh_would_hand_a_shell(in_tmp_cwd):
    """Over ssh, DeepSpeed's pdsh runner passes the worker's arguments as shell text that
    cannot be quoted from here: what a shell would act on there is refused."""
    spec = LaunchSpec(launcher="deepspeed", hostfile="hosts", master_addr="node1", master_port=29500)
    # DeepSpeed puts an argument with a space in double quotes, where ; & | are inert
    safe = [
        "cfg.yaml",
        "--set",
        "model.widths=[2,32,1]",
        "--set",
        'strategy={"name": "ddp", "bucket": 25}',
        "--out",
        "runs/a",
        "--set",
        "study=x; touch PWNED && it's | fine",
    ]
    assert "--no_ssh_check" in deepspeed_launch(spec, safe).commands[0]
    spaced_and_inert = {HOSTILE[name] for name in ("semicolon", "and", "pipe")}
    for hostile in [
        *(set(HOSTILE.values()) - spaced_and_inert),
        "x;touch",
        "a&&b",
        "x|y",
        "{a,b}",
        "~root",
        "*",
        "it's",
    ]:
        with pytest.raises(ConfigError, match="would reach each node's shell unquoted"):
            deepspeed_launch(spec, ["cfg.yaml", "--set", f"study={hostile}"])
    spaced = in_tmp_cwd / "a b"
    spaced.mkdir()
    os.chdir(spaced)  # DeepSpeed's remote command starts with `cd <this directory>;`, unquoted
    with pytest.raises(ConfigError, match=r"'.*a b'"):
        deepspeed_launch(spec, safe)


def test_host_names_and_addresses_are_accepted_and_nothing_else():
    for good in ("node1", "worker-0.svc", "n1.cluster.example.org.", "10.0.0.1", "::1", "fe80::1%eth0", "a" * 63):
        check_host_name(good, "--hosts")
    for bad in (
        "a;b",
        "$(x)",
        "node 1",
        "-oProxyCommand=x",
        "node1:22",
        "a..b",
        "-node",
        "node-",
        "a" * 64,
        "",
        "user@node1",
        "node_1",
        "nøde",
        "node1\n",
    ):
        with pytest.raises(ConfigError, match="is not a host name"):
            check_host_name(bad, "--hosts")
