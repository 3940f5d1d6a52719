"""What ``kanscale run`` (or one sweep point) asks for: an experiment and how to launch it."""

from __future__ import annotations

from dataclasses import dataclass, field

from launchers.launch.commands import LaunchSpec
from launchers.launch.slurm import SlurmOptions
from strategies.experiment import ExperimentConfig, load_experiment


@dataclass
class RunRequest:
    """One experiment and how to launch it, as ``kanscale run`` or a sweep point asks for it."""

    config: str
    out: str
    spec: LaunchSpec = field(default_factory=LaunchSpec)
    # the LaunchSpec fields the command line (or the study) set; the others may come from the
    # accelerate launch config, the hostfile or the environment (launchers.launch.resolve)
    given: frozenset[str] = frozenset()
    overrides: list[str] = field(default_factory=list)
    strategy: str | None = None
    slurm: SlurmOptions = field(
        default_factory=SlurmOptions
    )  # how the sbatch script asks for the job (--launcher slurm)
    job_name: str | None = None  # the SLURM job's name; default kanscale-<experiment name>-<strategy label>
    hosts: list[str] = field(default_factory=list)  # write a hostfile for these nodes
    oversubscribe: bool = False
    all_nodes_here: bool = False  # start every node on this machine (multi-node without a cluster)
    progress: bool = True
    resume: str | None = None  # a run directory to continue from its latest checkpoint
    port_source: str = ""  # where the resolved master port came from, for messages

    def train_args(self) -> list[str]:
        """What every rank's ``kanscale train`` gets: the same config, preset and overrides."""
        args = [self.config] + (["--strategy", self.strategy] if self.strategy else [])
        for override in self.overrides:
            args += ["--set", override]
        args += ["--resume", self.resume] if self.resume else []
        return args + ["--out", self.out] + ([] if self.progress else ["--no-progress"])

    def load(self) -> ExperimentConfig:
        return load_experiment(self.config, self.overrides, strategy=self.strategy, settings={"output.dir": self.out})

    @property
    def starts_accelerate(self) -> bool:
        """Whether ``accelerate launch`` starts the ranks: here, or on each node of a SLURM job."""
        return self.spec.launcher == "accelerate" or (
            self.spec.launcher == "slurm" and self.slurm.inner == "accelerate"
        )

    @property
    def over_ssh(self) -> bool:
        """Whether node 0's deepspeed launcher starts the hostfile's other nodes over ssh (pdsh)."""
        return self.spec.launcher == "deepspeed" and self.spec.hostfile is not None and not self.spec.no_ssh
