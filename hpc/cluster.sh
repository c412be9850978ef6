#!/usr/bin/env bash
# A single-node SLURM on this machine, for trying the hpc/*.sbatch scripts and for CI.
# Usage: hpc/cluster.sh start|stop|status|env
#   start   start munged, slurmctld and slurmd (no systemd needed) and wait for an idle node;
#           does nothing when they already run
#   stop    stop the daemons this script started (by the PIDs in their PID files)
#   status  say which daemons run and show sinfo; exit 0 only when all three run
#   env     print `export SLURM_CONF=...` for sbatch/srun/sinfo in your shell:
#           eval "$(hpc/cluster.sh env)"
# Needs Debian's packages: apt-get install slurmctld slurmd slurm-client munge.
# Everything (config, keys, logs, spool) lives in $RINGNET_SLURM_DIR (default
# /tmp/ringnet-slurm); the daemons and jobs run as the user who runs this script.
set -euo pipefail
STATE=${RINGNET_SLURM_DIR:-/tmp/ringnet-slurm}
CONF=$STATE/slurm.conf
SOCKET=$STATE/munge/munge.socket
CPUS=${RINGNET_SLURM_CPUS:-16}     # CPUs the node claims: more than the cores, so 4-rank jobs fit
DAEMONS="slurmd slurmctld munged"  # stop order

die() { echo "hpc/cluster.sh: $*" >&2; exit 2; }

pid_of() {  # print the PID of daemon $1 when it runs
  local file=$STATE/$1.pid pid
  [ -s "$file" ] || return 1
  pid=$(cat "$file")
  kill -0 "$pid" 2>/dev/null || return 1
  # A stale PID file whose number now belongs to another program does not count.
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] || return 1
  echo "$pid"
}

running() { pid_of munged >/dev/null && pid_of slurmctld >/dev/null && pid_of slurmd >/dev/null; }

write_config() {
  local host user
  host=$(hostname -s)
  user=$(id -un)
  mkdir -p "$STATE/munge" "$STATE/ctld" "$STATE/spool" "$STATE/log"
  chmod 700 "$STATE/munge"
  if [ ! -s "$STATE/munge/munge.key" ]; then
    head -c 1024 /dev/urandom > "$STATE/munge/munge.key"
    chmod 400 "$STATE/munge/munge.key"
  fi
  cat > "$CONF" <<EOF
# Written by hpc/cluster.sh: one node, no cgroups, no systemd.
ClusterName=ringnet
SlurmctldHost=$host(127.0.0.1)
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
SlurmctldPort=${RINGNET_SLURM_PORT:-6817}
SlurmdPort=$(( ${RINGNET_SLURM_PORT:-6817} + 1 ))
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# pip's MPICH speaks PMI-2 under srun (PMIx does not work with it).
MpiDefault=pmi2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
# sbatch --wait polls for the finished job: a small MinJobAge lets it return quickly.
MinJobAge=4
KillWait=5
InactiveLimit=0
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  for cmd in munged slurmctld slurmd sinfo sbatch srun; do
    command -v "$cmd" >/dev/null || die "$cmd not found: apt-get install slurmctld slurmd slurm-client munge"
  done
  if running; then
    echo "SLURM already running (SLURM_CONF=$CONF)"
    return 0
  fi
  stop >/dev/null          # half-started leftovers
  write_config
  munged --force --socket="$SOCKET" --key-file="$STATE/munge/munge.key" \
    --pid-file="$STATE/munged.pid" --log-file="$STATE/log/munged.log" \
    --seed-file="$STATE/munge/munged.seed" \
    || die "munged did not start; see $STATE/log/munged.log"
  SLURM_CONF=$CONF slurmctld -f "$CONF" || die "slurmctld did not start; see $STATE/log/slurmctld.log"
  SLURM_CONF=$CONF slurmd -f "$CONF" || die "slurmd did not start; see $STATE/log/slurmd.log"
  local i state=""
  for i in $(seq 1 60); do
    state=$(SLURM_CONF=$CONF sinfo -h -o %t 2>/dev/null | head -1 || true)
    case "$state" in idle|mix|alloc) break ;; esac
    sleep 0.5
  done
  case "$state" in
    idle|mix|alloc) echo "SLURM running: node $(hostname -s) $state, $CPUS CPUs (SLURM_CONF=$CONF)" ;;
    *) die "node did not come up (state '${state:-none}'); see $STATE/log/" ;;
  esac
}

stop() {
  local name pid i
  for name in $DAEMONS; do
    pid=$(pid_of "$name") || continue
    kill "$pid"
    for i in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid"; fi
    echo "stopped $name ($pid)"
  done
  rm -f "$STATE"/slurmd.pid "$STATE"/slurmctld.pid "$STATE"/munged.pid
}

status() {
  local name pid rc=0
  for name in munged slurmctld slurmd; do
    if pid=$(pid_of "$name"); then echo "$name running ($pid)"; else echo "$name not running"; rc=3; fi
  done
  if [ "$rc" -eq 0 ]; then SLURM_CONF=$CONF sinfo; fi
  return "$rc"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: hpc/cluster.sh start|stop|status|env" >&2; exit 2 ;;
esac
