#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine (as root): munge + slurmctld + slurmd, a `debug`
# partition holding every CPU, no accounting. Idempotent: a running cluster is left as it is.
# Installs Debian's slurm-wlm and munge first when sbatch is missing (apt-get).
# State lives under $GRAFT_SLURM_DIR (default /var/lib/graft-slurm); the config is /etc/slurm/slurm.conf.
set -euo pipefail

STATE=${GRAFT_SLURM_DIR:-/var/lib/graft-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# one-node test cluster written by graft_exp .ci/start_slurm.sh"

if ! command -v sbatch >/dev/null || ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    echo "start_slurm: $CONF exists and was not written by this script; not touching a real cluster" >&2
    exit 1
fi

host=$(hostname -s)
cpus=$(nproc)
# Leave 1 GiB to the system; Slurm refuses a node whose RealMemory exceeds what it finds.
mem_mb=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 1024 ))

mkdir -p "$STATE"/{ctld,d,log} /etc/slurm /run/munge /var/log/munge /var/lib/munge
cat > "$CONF" <<CONFEOF
$MARK
ClusterName=graft
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
# Short waits keep tests fast: kill 5 s after SIGTERM, poll the queue every 2 s.
KillWait=5
SchedulerParameters=sched_interval=2,bf_interval=2
MinJobAge=600
MpiDefault=none
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONFEOF

chown munge:munge /run/munge /var/log/munge /var/lib/munge
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
if ! pgrep -u munge -x munged >/dev/null; then
    su -s /bin/sh munge -c "/usr/sbin/munged"
fi
pgrep -x slurmctld >/dev/null || slurmctld -c -i
pgrep -x slurmd >/dev/null || slurmd

# Ready when the node is idle (or allocated by a previous test run's jobs).
for _ in $(seq 60); do
    if sinfo -h -o "%T" 2>/dev/null | grep -qE "idle|mix|alloc"; then
        echo "start_slurm: one-node cluster up ($host, $cpus CPUs, ${mem_mb} MB)"
        exit 0
    fi
    sleep 1
done
echo "start_slurm: the node did not become ready; see $STATE/log/" >&2
sinfo >&2 || true
exit 1
