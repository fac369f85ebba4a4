#!/usr/bin/env bash
# A one-node Slurm on this machine, for tests/fairseq_moe/hooks/test_compat_slurm.py: Debian's munge, slurmctld and slurmd,
# as root, on localhost; the node has all the machine's CPUs, whatever OMP_NUM_THREADS says. Installs them
# if missing (apt), writes /etc/slurm/slurm.conf, starts the daemons and waits until the node takes jobs.
# Idempotent: a running cluster is left as it is. Not needed to train: only the Slurm tests use it (they skip
# without srun).
set -euo pipefail
if [ "$(id -u)" != 0 ]; then echo "slurm_up.sh: needs root (it installs and starts daemons)" >&2; exit 1; fi
if ! command -v slurmd >/dev/null || ! command -v munged >/dev/null || ! command -v srun >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends slurmd slurmctld slurm-client munge >/dev/null
fi
HOST="$(hostname -s)"
# Every CPU of the machine: plain nproc honours OMP_NUM_THREADS (README: 1 per rank), and a node of 1 CPU
# would keep a 2-task srun waiting forever.
CPUS="$(nproc --all)"
# The node's name must resolve (slurmd, and the tasks meet at the step's first node by name).
getent hosts "$HOST" >/dev/null || echo "127.0.0.1 $HOST" >> /etc/hosts
if pgrep -x slurmctld >/dev/null && pgrep -x slurmd >/dev/null && sinfo -h -N -o "%N" 2>/dev/null | grep -qx "$HOST"; then
    exit 0  # (running already, maybe busy: left as it is)
fi
mkdir -p /etc/slurm /var/spool/slurmd /var/spool/slurmctld /var/log/slurm /run/munge /var/lib/munge /var/log/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=fairseq-moe-ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- munged
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 60); do
    if sinfo -h -N -o "%N %t" 2>/dev/null | grep -q "^$HOST idle"; then exit 0; fi
    sleep 1
done
echo "slurm_up.sh: the node $HOST did not become idle in 60 s; sinfo says:" >&2
sinfo -N -l >&2 || true
tail -5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
