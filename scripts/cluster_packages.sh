#!/usr/bin/env bash
# Install what `make test-cluster` needs: a one-machine SLURM cluster (slurm-wlm, munge), the
# deepspeed ssh path (openssh-server, pdsh) and a headless browser for the HTML report
# (chromium). Installs with apt-get when a program is missing
# and this is root on a machine with apt-get; otherwise says what is missing and why it cannot
# install it. Never fails: tests/cluster skips, naming what is missing, when a program is absent.
set -uo pipefail

# program -> Debian package
declare -A PACKAGE=(
  [slurmctld]=slurm-wlm [slurmd]=slurm-wlm [sbatch]=slurm-wlm [scontrol]=slurm-wlm [srun]=slurm-wlm
  [munged]=munge [sshd]=openssh-server [ssh]=openssh-client [ssh-keygen]=openssh-client [pdsh]=pdsh
  [chromium]=chromium
)
export PATH="$PATH:/usr/sbin:/sbin"

missing=()
for program in "${!PACKAGE[@]}"; do
  command -v "$program" >/dev/null 2>&1 || missing+=("${PACKAGE[$program]}")
done
# pdsh's ssh module is what DeepSpeed uses (PDSH_RCMD_TYPE=ssh)
if command -v pdsh >/dev/null 2>&1 && ! pdsh -L 2>/dev/null | grep -q '^Module: rcmd/ssh'; then
  missing+=(pdsh)
fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "cluster_packages: slurm-wlm, munge, openssh-server, pdsh and chromium are installed"
  exit 0
fi
packages=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
if [ "$(id -u)" != 0 ]; then
  echo "cluster_packages: missing ${packages}and not root: cannot install them (the cluster tests will skip)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "cluster_packages: missing ${packages}and no apt-get here: install them by hand (the cluster tests will skip)"
  exit 0
fi
echo "cluster_packages: installing ${packages}with apt-get"
export DEBIAN_FRONTEND=noninteractive
# Keep the packages' postinst scripts from starting system daemons: the tests start their own.
policy=/usr/sbin/policy-rc.d
added_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && added_policy=1
fi
# shellcheck disable=SC2086
if ! apt-get install -y -q --no-install-recommends $packages >/tmp/cluster_packages.log 2>&1; then
  apt-get update -q >>/tmp/cluster_packages.log 2>&1
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $packages >>/tmp/cluster_packages.log 2>&1 \
    || echo "cluster_packages: apt-get install $packages failed (see /tmp/cluster_packages.log); the cluster tests will skip"
fi
[ "$added_policy" = 1 ] && rm -f "$policy"
exit 0
