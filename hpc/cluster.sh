#!/usr/bin/env bash
# A SLURM on this machine, for trying the hpc/*.sbatch scripts and for CI: one node, or K
# nodes made of network namespaces joined by shaped links.
# Usage: hpc/cluster.sh start [--nodes K] [--link RATE] [--cpus-per-node C] [--cpu-period US]
#                            [--prefix NAME] [--subnet A.B.C.0/24]
#        hpc/cluster.sh stop|status|env|fail-node NAME|revive-node NAME
#   start   no flags (or --nodes 1): start munged, slurmctld and slurmd (no systemd needed) and
#           wait for an idle node; does nothing when they already run.
#           --nodes K (K >= 2, needs root): K nodes NAME1..NAMEK (--prefix, default "node"),
#           each a network namespace with its own host name (UTS namespace), address
#           (A.B.C.2.. of --subnet, default 10.27.0.0/24) and link (a veth pair) to a bridge
#           that holds A.B.C.1; one slurmd per node under one slurmctld in this machine's
#           namespace. --link RATE shapes every link in both directions with
#           `tc qdisc ... tbf rate RATE` (e.g. 1gbit, 10gbit; no --link: unshaped). A node's
#           route to the others acknowledges TCP data at once (`quickack 1`): a node held by
#           its quota would otherwise send its delayed acknowledgements only when it runs
#           again, past the sender's loss-probe timeout. Writes
#           the hosts file and the launcher that mpirun needs to reach the nodes (see env).
#           --cpus-per-node C: every process of a node (its slurmd and the jobs it starts,
#           and what mpirun starts there through the launcher) runs in a control group of
#           the node's own, ringnet-NAME, held to C cores by CFS bandwidth (cgroup v1's cpu
#           controller: cpu.cfs_quota_us of every cpu.cfs_period_us; cgroup v2: cpu.max);
#           C may be fractional (0.5: 5 ms of every 10 ms). Default: this machine's cores
#           (nproc) / K. C*K may not exceed nproc.
#           --cpu-period US: the quota's period in microseconds (1000 to 1000000, default
#           10000); C cores of it must make at least 1 ms. A node runs at a full core's
#           speed until its quota of the period is spent and is held for the rest: a
#           shorter period makes the throttle finer, a node more like a slower core.
#           A bad value, a name or address already taken, or a step that fails: one line,
#           exit 2, and whatever this start made is removed again.
#   stop    stop the daemons this script started (by the PIDs in their PID files); with K
#           nodes also remove every namespace, link, mount, control group and file start
#           made (what still runs in a node's group is killed first).
#           Exit 3 when nothing runs.
#   status  say which daemons run and show sinfo (with K nodes: each node's address, host
#           name, link state and rate, CPU quota and the CPU time its group used); exit 0
#           only when everything runs, every link is up and every node has its group
#   fail-node NAME   with K nodes: the node NAME crashes: every process in its namespace
#           (its slurmd and the job's ranks) is killed with SIGKILL and its link goes down,
#           so neither SLURM nor mpirun reaches it any more
#   revive-node NAME the crashed node comes back: its link up, its slurmd started again in
#           the node's control group (SLURM returns it to service when it registers)
#   env     print the lines that point sbatch/srun/sinfo (and, with K nodes, mpirun and MPI)
#           at this cluster in your shell: eval "$(hpc/cluster.sh env)"
# Needs Debian's packages: apt-get install slurmctld slurmd slurm-client munge.
# Everything (config, keys, logs, spool) lives in $RINGNET_SLURM_DIR (default
# /tmp/ringnet-slurm); the daemons and jobs run as the user who runs this script. Two
# clusters at once need their own RINGNET_SLURM_DIR and RINGNET_SLURM_PORT each. SLURM's
# step sockets live in its spool, so its path must be short (start names the bound).
# Jobs: each start numbers its jobs from a block of 10000 ids of its own (FirstJobId ..
# MaxJobId), the next one of a counter all clusters here share ($RINGNET_SLURM_JOBIDS,
# default /tmp/ringnet-slurm-jobids), so neither two clusters nor a cluster started again
# reuse an id. As a job ends, its epilog removes the MPICH shared memory
# (/dev/shm/mpich_shm_*) its ranks made and left: killed ranks leave it, and a later job of
# the same id would fail in MPI_Init. A finished job's record: log/jobcomp.log (sacct -c).
set -euo pipefail
STATE=${RINGNET_SLURM_DIR:-/tmp/ringnet-slurm}
CONF=$STATE/slurm.conf
SOCKET=$STATE/munge/munge.socket
CPUS=${RINGNET_SLURM_CPUS:-16}     # CPUs each node claims: more than the cores, so 4-rank jobs fit
PORT=${RINGNET_SLURM_PORT:-6817}   # slurmctld's; slurmd takes the next one
DAEMONS="slurmd slurmctld munged"  # stop order
MADE=$STATE/made                   # K nodes: what start made, one line each, in order
NODES_FILE=$STATE/nodes            # K nodes: "NAME ADDRESS HOST-SIDE-LINK" per node
HOSTS=$STATE/hosts                 # K nodes: mpirun's hosts file
NODE_EXEC=$STATE/node-exec         # K nodes: mpirun's launcher (in place of ssh)
# Job ids: each start numbers its jobs from a block of ids of its own, taken from a counter
# that all clusters on this machine share, so that no two clusters, and no cluster started
# again, give the same id twice (an id names a job's MPI shared memory, see write_scripts).
JOBIDS=${RINGNET_SLURM_JOBIDS:-/tmp/ringnet-slurm-jobids}
BLOCK=10000                        # ids a block holds: block B is B*BLOCK .. B*BLOCK+BLOCK-1
BLOCKS=6703                        # SLURM's ids end at 67043328
# What makes MPICH go over the links between namespaces: its TCP path through libfabric,
# and no shared memory between ranks of one node (the namespaces share one kernel, so a
# shared-memory or UCX path would cross "nodes" without touching the links).
MPI_ENV="MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp MPIR_CVAR_NOLOCAL=1"

die() { echo "hpc/cluster.sh: $*" >&2; exit 2; }

pid_of() {  # print the PID of daemon $1 (PID file $STATE/$1.pid, or $2) when it runs
  local file=${2:-$STATE/$1.pid} pid
  [ -s "$file" ] || return 1
  pid=$(cat "$file")
  kill -0 "$pid" 2>/dev/null || return 1
  # A stale PID file whose number now belongs to another program does not count.
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] || return 1
  echo "$pid"
}

running() { pid_of munged >/dev/null && pid_of slurmctld >/dev/null && pid_of slurmd >/dev/null; }
multi() { [ -e "$MADE" ]; }      # a K-node cluster was started here (and not stopped)
node_count() { wc -l < "$NODES_FILE" 2>/dev/null || echo 0; }

job_block() {  # take the next block of job ids from the counter (seeded from the clock)
  local b
  if ! b=$( (
      flock -w 10 9 || exit 1
      last=$(head -c 20 "$JOBIDS" 2>/dev/null || true)
      [[ $last =~ ^[0-9]+$ ]] || last=$(( $(date +%s) / 10 % BLOCKS ))
      next=$(( last % BLOCKS + 1 ))
      echo "$next" > "$JOBIDS" || exit 1
      echo "$next"
    ) 9>>"$JOBIDS" 2>/dev/null ); then
    b=$(( $(date +%s) % BLOCKS + 1 ))   # a counter this user cannot write: the clock picks
  fi
  chmod 666 "$JOBIDS" 2>/dev/null || true
  echo "$b"
}

write_scripts() {  # the prolog and epilog SLURM runs on a node as a job starts and ends there
  cat > "$STATE/prolog" <<EOF
#!/bin/sh
# Written by hpc/cluster.sh: SLURM runs it on a node as a job starts there. It notes the time
# in a file of the job's, for the epilog.
mkdir -p "$STATE/jobs" && : > "$STATE/jobs/\$SLURM_JOB_ID-\$SLURMD_NODENAME"
exit 0
EOF
  cat > "$STATE/epilog" <<EOF
#!/bin/bash
# Written by hpc/cluster.sh: SLURM runs it on a node as a job ends there. MPICH's shared
# memory segments (/dev/shm/mpich_shm_*) outlive ranks that were killed, and a later job
# whose segment takes the same name then fails in MPI_Init; this removes those the job's
# user made since the job started on the node that no process has open or mapped any more.
# (It exits 0 whatever happens: a failed epilog would drain the node.)
stamp="$STATE/jobs/\$SLURM_JOB_ID-\$SLURMD_NODENAME"
[ -e "\$stamp" ] || exit 0
left=\$(find /dev/shm -maxdepth 1 -name 'mpich_shm_*' -user "\$SLURM_JOB_UID" -newer "\$stamp" 2>/dev/null)
if [ -n "\$left" ]; then
  used=\$( { find /proc/[0-9]*/fd -lname '/dev/shm/mpich_shm_*' -printf '%l\\n'
             grep -ho '/dev/shm/mpich_shm_[^ ]*' /proc/[0-9]*/maps; } 2>/dev/null | sort -u)
  for f in \$left; do
    grep -qxF "\$f" <<<"\$used" && continue
    rm -f "\$f" && echo "\$(date '+%F %T') job \$SLURM_JOB_ID on \$SLURMD_NODENAME: removed \$f" \\
      "(made during the job, open or mapped by no process)" >> "$STATE/log/epilog.log"
  done
fi
rm -f "\$stamp"
exit 0
EOF
  chmod 755 "$STATE/prolog" "$STATE/epilog"
}

write_config() {  # write_config HOST_LINES...: slurm.conf; one node when no lines are given
  local host user block
  host=$(hostname -s)
  user=$(id -un)
  mkdir -p "$STATE/munge" "$STATE/ctld" "$STATE/spool" "$STATE/log"
  write_scripts
  block=$(job_block)
  chmod 700 "$STATE/munge"
  if [ ! -s "$STATE/munge/munge.key" ]; then
    head -c 1024 /dev/urandom > "$STATE/munge/munge.key"
    chmod 400 "$STATE/munge/munge.key"
  fi
  local ctld_addr=127.0.0.1 spool=$STATE/spool slurmd_pid=$STATE/slurmd.pid
  local slurmd_log=$STATE/log/slurmd.log title="one node, no cgroups, no systemd."
  if [ "$#" -gt 0 ]; then
    ctld_addr=$BRIDGE_ADDR spool=$STATE/spool/%n slurmd_pid=$STATE/slurmd-%n.pid
    slurmd_log=$STATE/log/slurmd-%n.log title="$# nodes (network namespaces), no cgroups, no systemd."
  fi
  cat > "$CONF" <<EOF
# Written by hpc/cluster.sh: $title
ClusterName=ringnet
SlurmctldHost=$host($ctld_addr)
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
SlurmctldPort=$PORT
SlurmdPort=$(( PORT + 1 ))
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$slurmd_log
# pip's MPICH speaks PMI-2 under srun (PMIx does not work with it).
MpiDefault=pmi2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
# sbatch --wait polls for the finished job every 2 s while MinJobAge is 5 or less, and
# otherwise after 2, 8, then every 32 s (at 300 a 12 s job returned after 42 s): a finished
# job leaves squeue and scontrol after 4 s, and its record is in JobCompLoc.
MinJobAge=4
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.log
# This start's own block of job ids (no other cluster here, or start, numbers from it).
FirstJobId=$(( block * BLOCK ))
MaxJobId=$(( block * BLOCK + BLOCK - 1 ))
# A job's node notes when it started there; as it ends, the epilog removes what its ranks
# left in /dev/shm.
Prolog=$STATE/prolog
Epilog=$STATE/epilog
KillWait=5
InactiveLimit=0
SlurmdParameters=config_overrides
EOF
  if [ "$#" -gt 0 ]; then
    cat >> "$CONF" <<EOF
# A node that stops answering (hpc/cluster.sh fail-node) is marked DOWN after this many
# seconds, and a job that ran on it requeued (SLURM's default is 300); a message to it is
# given up after MessageTimeout (default 10), which the pings that find it silent wait.
SlurmdTimeout=10
MessageTimeout=5
EOF
  fi
  if [ "$#" -eq 0 ]; then
    cat >> "$CONF" <<EOF
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  else
    local line names=()
    for line in "$@"; do
      set -- $line
      echo "NodeName=$1 NodeAddr=$2 CPUs=$CPUS State=UNKNOWN" >> "$CONF"
      names+=("$1")
    done
    local IFS=,
    echo "PartitionName=debug Nodes=${names[*]} Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
  fi
}

# SLURM's steps listen on Unix sockets in their node's spool folder, named
# NODE_JOBID.STEPID; a batch step's id is 4294967291 and the job ids here have up to 8
# digits. A socket's path holds at most 107 bytes: past that, slurmd cannot start a step and
# sbatch's or srun's tasks fail with "Unspecified error". check_socket_room SPOOL NODE: die,
# before anything is made, where NODE's longest socket in SPOOL would not fit.
check_socket_room() {
  local path="$1/$2_67043327.4294967291" room
  [ "${#path}" -le 107 ] && return 0
  room=$(( 107 - ${#path} + ${#STATE} ))
  die "RINGNET_SLURM_DIR=$STATE is too long: SLURM's socket $path would take ${#path} characters, over the 107 of a Unix socket's path; choose a folder of at most $room characters"
}

need_slurm() {
  for cmd in munged slurmctld slurmd sinfo sbatch srun; do
    command -v "$cmd" >/dev/null || die "$cmd not found: apt-get install slurmctld slurmd slurm-client munge"
  done
}

start_munged() {
  munged --force --socket="$SOCKET" --key-file="$STATE/munge/munge.key" \
    --pid-file="$STATE/munged.pid" --log-file="$STATE/log/munged.log" \
    --seed-file="$STATE/munge/munged.seed"
}

start() {
  need_slurm
  if multi; then die "a $(node_count)-node cluster runs in $STATE: hpc/cluster.sh stop it first"; fi
  if running; then
    echo "SLURM already running (SLURM_CONF=$CONF)"
    return 0
  fi
  check_socket_room "$STATE/spool" "$(hostname -s)"
  stop_daemons >/dev/null          # half-started leftovers
  write_config
  start_munged || die "munged did not start; see $STATE/log/munged.log"
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

# -- K nodes ------------------------------------------------------------------------------

# A step of start_nodes failed: remove what this start made, then say why in one line.
fail() {
  teardown >/dev/null 2>&1 || true
  die "$*"
}

# try WHAT COMMAND...: run it; on failure undo the start, naming WHAT and the command's error.
try() {
  local what=$1 out
  shift
  if ! out=$("$@" 2>&1); then
    out=$(printf '%s' "$out" | grep -v '^\s*$' | head -1)
    fail "$what${out:+: $out}"
  fi
}

made() { echo "$*" >> "$MADE"; }

# daemon WHAT LOG COMMAND...: start a daemon; when it does not start, undo the start,
# quoting the last line it printed or logged (the log goes with the rest).
daemon() {
  local what=$1 log=$2 out last
  shift 2
  if ! out=$("$@" 2>&1); then
    last=$( (printf '%s\n' "$out"; cat "$log" 2>/dev/null) | grep -v '^\s*$' | tail -1 || true)
    fail "$what did not start${last:+ ($last)}"
  fi
}

burst_of() {  # bytes a tbf of rate $1 may send at once: 1 ms of the rate, at least 64 KiB
  awk -v rate="$1" 'BEGIN {
    if (!match(rate, /^[0-9]+(\.[0-9]+)?/)) { print 65536; exit }
    n = substr(rate, 1, RLENGTH); unit = tolower(substr(rate, RLENGTH + 1))
    f["bit"] = f[""] = 1 / 8; f["kbit"] = 1e3 / 8; f["mbit"] = 1e6 / 8; f["gbit"] = 1e9 / 8
    f["tbit"] = 1e12 / 8; f["bps"] = 1; f["kbps"] = 1e3; f["mbps"] = 1e6; f["gbps"] = 1e9
    f["tbps"] = 1e12; f["kibit"] = 1024 / 8; f["mibit"] = 1048576 / 8; f["gibit"] = 2^30 / 8
    f["tibit"] = 2^40 / 8; f["kibps"] = 1024; f["mibps"] = 1048576; f["gibps"] = 2^30
    f["tibps"] = 2^40
    b = (unit in f) ? n * f[unit] / 1000 : 65536
    printf "%d\n", (b < 65536 ? 65536 : b) }'
}

shape() {  # shape NETNS-OR-"" DEVICE RATE: tbf on the device's egress
  local ns=$1 dev=$2 rate=$3
  local out
  if ! out=$(tc ${ns:+-n "$ns"} qdisc add dev "$dev" root tbf rate "$rate" \
        burst "$(burst_of "$rate")" latency 50ms 2>&1); then
    fail "--link $rate: tc refuses it ($(printf '%s' "$out" | head -1))"
  fi
}

# -- CPU quotas: a control group per node ----------------------------------------------------

# find_cpu_controller: set CG_KIND (v1 or v2), CG_CPU (the cpu controller's hierarchy) and
# CG_ACCT (v1: the cpuacct hierarchy that counts a group's CPU time, when it is mounted;
# v2: the same as CG_CPU); fail when there is no cpu controller to use.
find_cpu_controller() {
  local dev mnt type opts rest o v1cpu="" v1acct="" v2=""
  while read -r dev mnt type opts rest; do
    case "$type" in
      cgroup)
        for o in ${opts//,/ }; do
          [ "$o" != cpu ] || v1cpu=$mnt
          [ "$o" != cpuacct ] || v1acct=$mnt
        done ;;
      cgroup2) [ -n "$v2" ] || v2=$mnt ;;
    esac
  done < /proc/mounts
  if [ -n "$v1cpu" ] && [ -e "$v1cpu/cpu.cfs_quota_us" ]; then
    CG_KIND=v1 CG_CPU=$v1cpu CG_ACCT=""
    [ -z "$v1acct" ] || [ ! -e "$v1acct/cpuacct.usage" ] || CG_ACCT=$v1acct
    return 0
  fi
  if [ -n "$v2" ] && grep -qw cpu "$v2/cgroup.controllers" 2>/dev/null; then
    CG_KIND=v2 CG_CPU=$v2 CG_ACCT=$v2
    return 0
  fi
  return 1
}

quota_of() {  # quota_of C [PERIOD]: "QUOTA PERIOD" in microseconds for C cores (at least 1 ms
  # a period; without PERIOD, 10 ms or longer where C needs it)
  awk -v c="$1" -v given="${2:-}" 'BEGIN {
    p = given == "" ? 10000 : given + 0; q = int(c * p + 0.5)
    if (q < 1000 && given != "") exit 1
    if (q < 1000) { p = int(1000 / c + 0.5); q = 1000 }
    if (p > 1000000) exit 1
    print q, p }'
}

group_dirs() {  # group_dirs NAME: node NAME's control groups (cpu, then cpuacct if apart)
  echo "$CG_CPU/ringnet-$1"
  if [ -n "$CG_ACCT" ] && [ "$CG_ACCT" != "$CG_CPU" ]; then echo "$CG_ACCT/ringnet-$1"; fi
}

make_group() {  # make_group NAME QUOTA PERIOD: node NAME's groups, with the quota
  local name=$1 quota=$2 period=$3 dir
  for dir in $(group_dirs "$name"); do
    try "cannot make control group $dir" mkdir "$dir"
    made "cgroup $dir"
  done
  dir=$CG_CPU/ringnet-$name
  if [ "$CG_KIND" = v1 ]; then
    try "cannot set the CPU period of $dir" sh -c "echo $period > '$dir/cpu.cfs_period_us'"
    try "cannot set the CPU quota of $dir" sh -c "echo $quota > '$dir/cpu.cfs_quota_us'"
  else
    try "cannot set the CPU quota of $dir" sh -c "echo '$quota $period' > '$dir/cpu.max'"
  fi
}

# in_group NAME COMMAND...: run COMMAND in node NAME's control groups. The (sub)shell that
# runs it moves itself there first, so COMMAND and every process it starts belong to them:
# call it only from a subshell (as try and daemon do).
in_group() {
  local name=$1 dir
  shift
  for dir in $(group_dirs "$name"); do
    if ! echo "$BASHPID" > "$dir/cgroup.procs"; then
      echo "cannot enter control group $dir" >&2
      return 1
    fi
  done
  "$@"
}

group_pids() {  # group_pids NAME: the processes in node NAME's groups
  local dir
  for dir in $(group_dirs "$1"); do cat "$dir/cgroup.procs" 2>/dev/null || true; done | sort -un
}

remove_group() {  # remove_group DIR: kill what still runs in it, then remove it
  local dir=$1 i pids
  [ -d "$dir" ] || return 0
  for i in $(seq 1 100); do
    pids=$(cat "$dir/cgroup.procs" 2>/dev/null || true)
    [ -n "$pids" ] || break
    kill -9 $pids 2>/dev/null || true
    sleep 0.05
  done
  for i in $(seq 1 50); do
    rmdir "$dir" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "hpc/cluster.sh: cannot remove control group $dir" >&2
}

group_usage() {  # group_usage NAME: "QUOTA-TEXT, S s of CPU used" from node NAME's group
  local cpu=$CG_CPU/ringnet-$1 acct=${CG_ACCT:+$CG_ACCT/ringnet-$1} quota period used=""
  [ -d "$cpu" ] || return 1
  if [ "$CG_KIND" = v1 ]; then
    quota=$(cat "$cpu/cpu.cfs_quota_us") period=$(cat "$cpu/cpu.cfs_period_us")
    [ -z "$acct" ] || used=$(awk '{printf "%.2f", $1 / 1e9}' "$acct/cpuacct.usage" 2>/dev/null)
  else
    read -r quota period < "$cpu/cpu.max"
    used=$(awk '$1 == "usage_usec" {printf "%.2f", $2 / 1e6}' "$cpu/cpu.stat" 2>/dev/null)
  fi
  if [ "$quota" = -1 ] || [ "$quota" = max ]; then
    printf 'no CPU quota'
  else
    awk -v q="$quota" -v p="$period" 'BEGIN {c = q / p; printf "CPU quota %g core%s (%d of every %d us)", c, (c == 1 ? "" : "s"), q, p}'
  fi
  printf ', %s s of CPU used' "${used:-?}"
}

start_nodes() {  # start_nodes K RATE PREFIX SUBNET CPUS-PER-NODE (empty: nproc / K) PERIOD (empty: 10 ms)
  local k=$1 rate=$2 prefix=$3 subnet=$4 cpus=$5 given_period=$6
  [[ $prefix =~ ^[a-z][a-z0-9-]{0,7}$ && ! $prefix =~ [0-9]$ ]] ||
    die "--prefix $prefix: 1 to 8 lower-case letters, digits or '-', starting with a letter and not ending in a digit"
  [[ $subnet =~ ^(10|172\.(1[6-9]|2[0-9]|3[01])|192\.168)\.[0-9]+(\.[0-9]+)?\.0/24$ ]] &&
    [ "$(tr -cd . <<<"$subnet" | wc -c)" -eq 3 ] ||
    die "--subnet $subnet: give a private /24 such as 10.27.0.0/24 (10/8, 172.16/12 or 192.168/16)"
  local base=${subnet%.0/24} o
  for o in ${base//./ }; do [ "$o" -le 255 ] || die "--subnet $subnet: not an IPv4 network"; done
  local max=253   # A.B.C.2 .. A.B.C.254
  [ "$k" -le "$max" ] || die "--nodes $k: at most $max nodes fit in $subnet (one address each)"
  local cores quota period q given_cpus=$cpus
  cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)   # nproc honours OMP_NUM_THREADS
  [ -n "$cpus" ] || cpus=$(awk -v n="$cores" -v k="$k" 'BEGIN {printf "%.6g", n / k}')
  if ! q=$(quota_of "$cpus" "$given_period"); then
    # with a period given, only C cores of it under 1 ms; without, C too small for 1 s
    [ -z "$given_period" ] ||
      die "--cpu-period $given_period: $cpus cores of it are less than 1 ms; give a longer period"
    [ -n "$given_cpus" ] ||
      die "--nodes $k: this machine's $cores cores make less than 0.001 core a node; give --cpus-per-node"
    die "--cpus-per-node $cpus: give 0.001 cores or more (a quota of at least 1 ms a second)"
  fi
  if [ -n "$given_cpus" ]; then
    awk -v c="$cpus" -v k="$k" -v n="$cores" 'BEGIN {exit !(c * k > n + 1e-9)}' &&
      die "--cpus-per-node $cpus: $k nodes of $cpus cores are $(awk -v c="$cpus" -v k="$k" 'BEGIN {printf "%g", c * k}') cores, more than this machine's $cores"
  fi
  read -r quota period <<<"$q"
  [ "$(id -u)" -eq 0 ] || die "--nodes $k needs root (network namespaces, links, tc and control groups); run it as root"
  for cmd in ip tc nsenter unshare; do
    command -v "$cmd" >/dev/null || die "$cmd not found: apt-get install iproute2 util-linux"
  done
  find_cpu_controller ||
    die "no cpu controller to hold each node to its cores: neither cgroup v1's cpu hierarchy nor cgroup v2 with cpu is mounted (see /proc/mounts)"
  need_slurm

  if multi; then die "a $(node_count)-node cluster already runs in $STATE: hpc/cluster.sh stop it first"; fi
  if pid_of slurmctld >/dev/null || pid_of munged >/dev/null; then
    die "a single-node SLURM runs in $STATE: stop it (hpc/cluster.sh stop), or give this cluster its own RINGNET_SLURM_DIR and RINGNET_SLURM_PORT"
  fi
  # Clashes: nothing is made before every name, address and port is known to be free.
  local host i name dir bridge=$prefix-br names=()
  host=$(hostname -s)
  for i in $(seq 1 "$k"); do names+=("$prefix$i"); done
  for name in "${names[@]}"; do
    [ "$name" != "$host" ] || die "node name $name is this machine's host name: choose another --prefix"
    [ ! -e "/run/netns/$name" ] || die "network namespace $name exists already: choose another --prefix"
    ! ip link show "$name-h" >/dev/null 2>&1 || die "link $name-h exists already: choose another --prefix"
    for dir in $(group_dirs "$name"); do
      [ ! -e "$dir" ] || die "control group $dir exists already: choose another --prefix"
    done
  done
  ! ip link show "$bridge" >/dev/null 2>&1 || die "link $bridge exists already: choose another --prefix"
  for name in "${names[@]}"; do check_socket_room "$STATE/spool/$name" "$name"; done
  local taken
  taken=$(ip -4 -o addr show | awk -v b="$base." '{split($4, a, "/"); if (index(a[1], b) == 1) print $2}')
  [ -z "$taken" ] || die "--subnet $subnet: $(head -1 <<<"$taken") has an address in it already: choose another --subnet"
  taken=$(ip -4 route show | awk -v s="$subnet" '$1 == s')
  [ -z "$taken" ] || die "--subnet $subnet: this machine routes it already: choose another --subnet"
  taken=$(awk -v p="$(printf ':%04X' "$PORT")" 'FNR > 1 && $4 == "0A" && substr($2, length($2) - 4) == p' \
          /proc/net/tcp /proc/net/tcp6 2>/dev/null)
  [ -z "$taken" ] || die "port $PORT is taken (another SLURM?): set RINGNET_SLURM_PORT"

  # From here on every step is recorded in $MADE and a failure undoes them all.
  if [ ! -d "$STATE" ]; then
    mkdir -p "$STATE"
    echo "dir $STATE" > "$MADE"
  else
    : > "$MADE"
  fi
  rm -f "$NODES_FILE" "$HOSTS"
  trap 'fail "interrupted"' INT TERM
  BRIDGE_ADDR=$base.1
  if [ ! -d /run/netns ]; then made "dir /run/netns"; fi
  try "cannot make bridge $bridge" ip link add "$bridge" type bridge
  made "link $bridge"
  try "cannot address bridge $bridge" ip addr add "$BRIDGE_ADDR/24" dev "$bridge"
  try "cannot bring up bridge $bridge" ip link set "$bridge" up
  if [ "$CG_KIND" = v2 ] && ! grep -qw cpu "$CG_CPU/cgroup.subtree_control"; then
    # the groups below the root get the cpu controller (left on: other groups may use it)
    try "cannot give control groups the cpu controller" sh -c "echo +cpu > '$CG_CPU/cgroup.subtree_control'"
  fi
  mkdir -p "$STATE/uts"
  local lines=() addr
  for i in $(seq 1 "$k"); do
    name=$prefix$i
    addr=$base.$((i + 1))
    try "cannot make network namespace $name" ip netns add "$name"
    made "netns $name"
    make_group "$name" "$quota" "$period"
    try "cannot make link $name-h" ip link add "$name-h" type veth peer name eth0 netns "$name"
    made "link $name-h"
    try "cannot attach $name-h to $bridge" ip link set "$name-h" master "$bridge" up
    try "cannot address $name" ip -n "$name" addr add "$addr/24" dev eth0
    try "cannot bring up $name's eth0" ip -n "$name" link set eth0 up
    try "cannot bring up $name's lo" ip -n "$name" link set lo up
    try "cannot set $name's route to acknowledge at once" \
      ip -n "$name" route replace "$subnet" dev eth0 proto kernel scope link src "$addr" quickack 1
    if [ -n "$rate" ]; then
      shape "" "$name-h" "$rate"       # towards the node
      shape "$name" eth0 "$rate"       # from the node
    fi
    : > "$STATE/uts/$name"
    made "file $STATE/uts/$name"
    try "cannot give $name its host name" unshare --uts="$STATE/uts/$name" hostname "$name"
    made "mount $STATE/uts/$name"
    lines+=("$name $addr $name-h")
  done
  printf '%s\n' "${lines[@]}" > "$NODES_FILE"
  printf '%s\n' "${names[@]}" > "$HOSTS"
  write_node_exec
  {
    echo "rate=$rate"
    echo "prefix=$prefix"
    echo "subnet=$subnet"
    echo "bridge=$bridge"
    echo "bridge_addr=$BRIDGE_ADDR"
    echo "cpus=$cpus"
    echo "CG_KIND=$CG_KIND"
    echo "CG_CPU=$CG_CPU"
    echo "CG_ACCT=$CG_ACCT"
  } > "$STATE/cluster"

  write_config "${lines[@]}"
  made "daemon munged $STATE/munged.pid"
  daemon munged "$STATE/log/munged.log" start_munged
  made "daemon slurmctld $STATE/slurmctld.pid"
  daemon slurmctld "$STATE/log/slurmctld.log" env SLURM_CONF="$CONF" slurmctld -f "$CONF"
  for name in "${names[@]}"; do
    made "daemon slurmd $STATE/slurmd-$name.pid"
    daemon "slurmd of $name" "$STATE/log/slurmd-$name.log" \
      in_group "$name" nsenter --net="/run/netns/$name" --uts="$STATE/uts/$name" -- \
      env SLURM_CONF="$CONF" slurmd -f "$CONF" -N "$name"
  done
  local states="" up
  for i in $(seq 1 120); do
    states=$(SLURM_CONF=$CONF sinfo -h -N -o "%N %t" 2>/dev/null || true)
    up=$(awk '$2 ~ /^(idle|mix|alloc)$/' <<<"$states" | wc -l)
    [ "$up" -eq "$k" ] && break
    sleep 0.5
  done
  if [ "$up" -ne "$k" ]; then
    local last
    last=$(grep -hv '^\s*$' "$STATE"/log/slurmd-*.log "$STATE/log/slurmctld.log" 2>/dev/null | tail -1 || true)
    fail "$((k - up)) of $k nodes did not come up ($(tr '\n' ' ' <<<"$states" | sed 's/ $//'))${last:+; last log line: $last}"
  fi
  trap - INT TERM
  local shaped="unshaped links"
  [ -z "$rate" ] || shaped="links of $rate each way (tbf)"
  echo "SLURM running: $k nodes ${names[0]}..${names[$((k - 1))]} ($base.2-$((k + 1))), $CPUS CPUs each on a quota of $cpus core(s) ($quota of every $period us), $shaped (SLURM_CONF=$CONF)"
}

write_node_exec() {
  # mpirun's launcher in place of ssh: hydra calls it as `ssh [options] HOST COMMAND...`;
  # it runs COMMAND in the node's network and UTS namespaces and control groups (hydra's
  # proxy then changes to the job's folder itself).
  local groups
  groups=$(group_dirs @HOST@ | sed 's|$|/cgroup.procs|' | tr '\n' ' ')
  groups=${groups//@HOST@/\$host}
  cat > "$NODE_EXEC" <<EOF
#!/usr/bin/env bash
# Written by hpc/cluster.sh: runs a command on a node of the cluster in $STATE, as ssh would.
while [ "\$#" -gt 0 ]; do
  case "\$1" in
    -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=\$1
shift
if [ ! -e "/run/netns/\$host" ] || [ ! -e "$STATE/uts/\$host" ]; then
  echo "node-exec: \$host is not a node of the cluster in $STATE" >&2
  exit 255
fi
for group in $groups; do
  if ! echo \$\$ > "\$group" 2>/dev/null; then
    echo "node-exec: cannot enter \${group%/cgroup.procs}: \$host's processes run there" >&2
    exit 255
  fi
done
exec nsenter --net="/run/netns/\$host" --uts="$STATE/uts/\$host" -- /bin/sh -c "\$*"
EOF
  chmod 755 "$NODE_EXEC"
}

teardown() {  # undo every line of $MADE, last first; then the record itself
  [ -e "$MADE" ] || return 0
  local kind what file pid i
  while read -r kind what file; do
    case "$kind" in
      daemon)
        pid=$(pid_of "$what" "$file") || { rm -f "$file"; continue; }
        kill "$pid" 2>/dev/null || true
        for i in $(seq 1 50); do
          kill -0 "$pid" 2>/dev/null || break
          sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
        rm -f "$file"
        echo "stopped $what ($pid)" ;;
      mount) umount "$what" 2>/dev/null || umount -l "$what" 2>/dev/null || true ;;
      cgroup) remove_group "$what" ;;
      file) rm -f "$what" ;;
      netns)
        # Processes still inside (a job's ranks) would keep the namespace alive.
        for pid in $(ip netns pids "$what" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$what" 2>/dev/null || true ;;
      link) ip link del "$what" 2>/dev/null || true ;;
      dir)
        if [ "$what" = /run/netns ] && [ -z "$(ls -A /run/netns 2>/dev/null)" ]; then
          # ip netns made it a mount point (bound on itself): undo that too
          while mountpoint -q /run/netns; do umount /run/netns 2>/dev/null || break; done
        fi
        [ "$what" = "$STATE" ] || rmdir "$what" 2>/dev/null || true ;;
    esac
  done < <(tac "$MADE")
  local created=0
  grep -qx "dir $STATE" "$MADE" && created=1
  rm -rf "$STATE/uts" "$STATE/ctld" "$STATE/spool" "$STATE/log" "$STATE/munge" \
    "$STATE/slurm.conf" "$STATE/cluster" "$NODES_FILE" "$HOSTS" "$NODE_EXEC" \
    "$STATE/prolog" "$STATE/epilog" "$STATE/jobs" \
    "$STATE"/slurmd-*.pid "$STATE/slurmctld.pid" "$STATE/munged.pid"
  rm -f "$MADE"
  if [ "$created" -eq 1 ]; then rmdir "$STATE" 2>/dev/null || true; fi
}

# -- stop, status, env --------------------------------------------------------------------

stop_daemons() {
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

stop() {
  if multi; then
    local k
    k=$(node_count)
    [ "$(id -u)" -eq 0 ] || die "stopping the $k-node cluster in $STATE needs root"
    teardown
    echo "removed the $k-node cluster (namespaces, links, mounts, control groups and files in $STATE)"
    return 0
  fi
  if ! pid_of munged >/dev/null && ! pid_of slurmctld >/dev/null && ! pid_of slurmd >/dev/null; then
    echo "hpc/cluster.sh: nothing to stop: no cluster runs in $STATE" >&2
    exit 3
  fi
  stop_daemons
}

rate_of() {  # rate_of NETNS-OR-"" DEVICE: the rate of the device's tbf, if it has one
  tc ${1:+-n "$1"} qdisc show dev "$2" 2>/dev/null |
    awk '$2 == "tbf" {for (i = 1; i < NF; i++) if ($i == "rate") print $(i + 1)}'
}

status() {
  local name pid rc=0
  if ! multi; then
    for name in munged slurmctld slurmd; do
      if pid=$(pid_of "$name"); then echo "$name running ($pid)"; else echo "$name not running"; rc=3; fi
    done
    if [ "$rc" -eq 0 ]; then SLURM_CONF=$CONF sinfo; fi
    return "$rc"
  fi
  local rate="" bridge="" bridge_addr="" subnet="" cpus="" addr link state shaped uts_host cpu
  load_cluster
  echo "cluster of $(node_count) nodes in $STATE: bridge $bridge ($bridge_addr, $subnet)," \
       "links ${rate:-unshaped}${cpus:+, $cpus core(s) a node}"
  for name in munged slurmctld; do
    if pid=$(pid_of "$name"); then echo "$name running ($pid)"; else echo "$name not running"; rc=3; fi
  done
  while read -r name addr link; do
    state=$(cat "/sys/class/net/$link/operstate" 2>/dev/null || echo missing)
    [ "$state" = up ] || rc=3
    shaped=$(rate_of "" "$link")
    [ -z "$shaped" ] || shaped=" (tbf $shaped to the node, $(rate_of "$name" eth0 || true) from it)"
    uts_host=$(nsenter --uts="$STATE/uts/$name" hostname 2>/dev/null || echo "?")
    if pid=$(pid_of slurmd "$STATE/slurmd-$name.pid"); then pid="slurmd running ($pid)"; else pid="slurmd not running"; rc=3; fi
    cpu=""
    if [ -n "$CG_CPU" ]; then
      if cpu=$(group_usage "$name"); then cpu=", $cpu"; else cpu=", control group missing"; rc=3; fi
    fi
    echo "node $name: address $addr, host name $uts_host, link $link $state$shaped, $pid$cpu"
  done < "$NODES_FILE"
  if pid_of slurmctld >/dev/null; then SLURM_CONF=$CONF sinfo -N -l | tail -n +2; fi
  return "$rc"
}

load_cluster() {  # the settings start wrote for the K-node cluster (CG_* empty before groups)
  CG_KIND="" CG_CPU="" CG_ACCT=""
  # shellcheck disable=SC1090
  . "$STATE/cluster"
}

check_node() {  # check_node NAME COMMAND: die unless NAME is a node of the running K-node cluster
  multi || die "$2: no K-node cluster runs in $STATE (hpc/cluster.sh start --nodes K)"
  [ "$(id -u)" -eq 0 ] || die "$2 needs root (namespaces and links)"
  awk -v n="$1" '$1 == n {found = 1} END {exit !found}' "$NODES_FILE" ||
    die "$2 $1: not a node of the cluster in $STATE ($(awk '{print $1}' "$NODES_FILE" | paste -sd ' '))"
}

fail_node() {
  local name=$1 addr link pid
  check_node "$name" fail-node
  read -r name addr link <<<"$(awk -v n="$name" '$1 == n' "$NODES_FILE")"
  ip link set "$link" down
  load_cluster
  local pids
  pids=$(ip netns pids "$name")
  if [ -n "$CG_CPU" ]; then pids+=" $(group_pids "$name")"; fi
  for pid in $pids; do kill -9 "$pid" 2>/dev/null || true; done
  rm -f "$STATE/slurmd-$name.pid"
  echo "node $name failed: its processes killed, link $link down"
}

revive_node() {
  local name=$1 addr link
  check_node "$name" revive-node
  read -r name addr link <<<"$(awk -v n="$name" '$1 == n' "$NODES_FILE")"
  if pid_of slurmd "$STATE/slurmd-$name.pid" >/dev/null; then
    die "revive-node $name: its slurmd runs; the node has not failed"
  fi
  ip link set "$link" up
  load_cluster
  local out run=()
  if [ -n "$CG_CPU" ]; then run=(in_group "$name"); fi
  out=$("${run[@]}" nsenter --net="/run/netns/$name" --uts="$STATE/uts/$name" -- \
        env SLURM_CONF="$CONF" slurmd -f "$CONF" -N "$name" 2>&1) ||
    die "revive-node $name: slurmd did not start ($(printf '%s' "$out" | tail -1))"
  echo "node $name back: link $link up, slurmd started${run:+ in its control group}"
}

env_lines() {
  echo "export SLURM_CONF=$CONF"
  if multi; then
    local bridge=""
    # shellcheck disable=SC1090
    . "$STATE/cluster"
    echo "export $MPI_ENV"
    echo "export HYDRA_LAUNCHER=ssh HYDRA_LAUNCHER_EXEC=$NODE_EXEC HYDRA_HOST_FILE=$HOSTS HYDRA_IFACE=$bridge"
  fi
}

cmd=${1:-}
[ "$#" -gt 0 ] && shift
case "$cmd" in
  start)
    nodes="" rate="" cpus="" period="" prefix=node subnet=10.27.0.0/24
    while [ "$#" -gt 0 ]; do
      case "$1" in
        --nodes|--link|--cpus-per-node|--cpu-period|--prefix|--subnet)
          [ "$#" -ge 2 ] || die "$1 needs a value"
          case "$1" in
            --nodes) nodes=$2 ;;
            --link) rate=$2 ;;
            --cpus-per-node) cpus=$2 ;;
            --cpu-period) period=$2 ;;
            --prefix) prefix=$2 ;;
            --subnet) subnet=$2 ;;
          esac
          shift 2 ;;
        *) die "start: unknown option $1 (start [--nodes K] [--link RATE] [--cpus-per-node C] [--cpu-period US] [--prefix NAME] [--subnet A.B.C.0/24])" ;;
      esac
    done
    if [ -n "$nodes" ]; then
      [[ $nodes =~ ^[0-9]+$ ]] || die "--nodes $nodes: give a whole number of nodes, 1 or more"
      nodes=$((10#$nodes))
      [ "$nodes" -ge 1 ] || die "--nodes 0: give 1 or more nodes"
    fi
    if [ -n "$rate" ] && [ "${nodes:-1}" -lt 2 ]; then
      die "--link $rate shapes the links between nodes: give --nodes 2 or more"
    fi
    if [ -n "$cpus" ]; then
      [[ $cpus =~ ^([0-9]+(\.[0-9]*)?|\.[0-9]+)$ ]] ||
        die "--cpus-per-node $cpus: give a number of cores, such as 1 or 0.5"
      awk -v c="$cpus" 'BEGIN {exit !(c + 0 > 0)}' || die "--cpus-per-node $cpus: give more than 0 cores"
      [ "${nodes:-1}" -ge 2 ] || die "--cpus-per-node $cpus gives each node of a cluster its own cores: give --nodes 2 or more"
    fi
    if [ -n "$period" ]; then
      [[ $period =~ ^[0-9]+$ ]] && [ "$((10#$period))" -ge 1000 ] && [ "$((10#$period))" -le 1000000 ] ||
        die "--cpu-period $period: give the quota's period in microseconds, 1000 to 1000000"
      period=$((10#$period))
      [ "${nodes:-1}" -ge 2 ] || die "--cpu-period $period sets the period of the nodes' CPU quota: give --nodes 2 or more"
    fi
    if [ "$prefix$subnet" != node10.27.0.0/24 ] && [ "${nodes:-1}" -lt 2 ]; then
      die "--prefix and --subnet name the nodes and their addresses: give --nodes 2 or more"
    fi
    if [ "${nodes:-1}" -eq 1 ]; then start; else start_nodes "$nodes" "$rate" "$prefix" "$subnet" "$cpus" "$period"; fi ;;
  stop) stop ;;
  status) status ;;
  env) env_lines ;;
  fail-node|revive-node)
    [ "$#" -eq 1 ] || die "$cmd: give one node name"
    if [ "$cmd" = fail-node ]; then fail_node "$1"; else revive_node "$1"; fi ;;
  *) echo "usage: hpc/cluster.sh start [--nodes K] [--link RATE] [--cpus-per-node C] [--cpu-period US] [--prefix NAME] [--subnet A.B.C.0/24]|stop|status|env|fail-node NAME|revive-node NAME" >&2; exit 2 ;;
esac
