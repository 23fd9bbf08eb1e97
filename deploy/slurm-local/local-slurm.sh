#!/usr/bin/env bash
# A real Slurm cluster of separate hosts on one Linux machine, to try `streamgrpo slurm` before a cluster
# (docs/cluster.md, "Try it on one machine"). Needs root, iproute2, util-linux and Debian's slurm-wlm and
# munge (`apt-get install --no-install-recommends slurmd slurmctld slurm-client munge`).
#
#   deploy/slurm-local/local-slurm.sh up [--hosts 3] [--gpus 2] [--cpus 8] [--mem-mib 16000] [--share DIR]...
#   deploy/slurm-local/local-slurm.sh exec HOST COMMAND...   # run COMMAND on host HOST (0 is the head)
#   deploy/slurm-local/local-slurm.sh down
#   deploy/slurm-local/local-slurm.sh check                  # exit 3 with the reason where this machine cannot
#
# Each host is a network + mount + UTS namespace: its own address on a bridge (10.213.7.10+i in a
# namespace of its own; nothing reaches the machine's networks), its own hostname (<name>-<i>), its own
# /tmp and /dev/shm (tmpfs). Everything else of the machine's file system is every host's, as a cluster's
# shared file system: keep the run directory outside /tmp, or name it with --share (a folder under /tmp
# that every host then sees, as it is). One slurmd per host, slurmctld on host 0, one munged for all.
# The GPUs are Slurm GRES over stand-in device files: Slurm counts, allocates and binds them
# (CUDA_VISIBLE_DEVICES) as it would real ones, and nothing uses them.
#
# STREAMGRPO_SLURM_NAME (default sgslurm) names the namespaces, the hosts and the state folder
# (/var/tmp/<name>: slurm.conf, logs, munge key, pid files), so two clusters can coexist and `down` removes
# exactly what `up` made. `exec` runs with SLURM_CONF set, so sbatch, srun, squeue and scontrol just work.
set -euo pipefail

NAME=${STREAMGRPO_SLURM_NAME:-sgslurm}
STATE=${STREAMGRPO_SLURM_STATE:-/var/tmp/$NAME}
SUBNET=10.213.7
die() { echo "local-slurm: $*" >&2; exit 2; }
cannot() { echo "local-slurm: $*" >&2; exit 3; }  # this machine cannot (exit 3: tests skip with this line)

host_pid() {  # the PID of host $1's slurmd: its namespaces are the host's
  local f="$STATE/run/slurmd-$1.pid"
  [[ -s $f ]] && kill -0 "$(cat "$f")" 2>/dev/null || die "host $1 is not up ($f): run '$0 up' first"
  cat "$f"
}

check() {
  [[ $(id -u) = 0 ]] || cannot "needs root (network and mount namespaces)"
  local t
  for t in ip unshare nsenter slurmctld slurmd sbatch munged; do
    command -v "$t" >/dev/null || cannot "$t not found: apt-get install --no-install-recommends iproute2 util-linux slurmd slurmctld slurm-client munge"
  done
  ip netns add "$NAME-probe" 2>/dev/null || cannot "this machine cannot make network namespaces (ip netns add failed)"
  ip netns del "$NAME-probe"
  unshare --mount --uts true 2>/dev/null || cannot "this machine cannot make mount/UTS namespaces (unshare failed)"
}

# Enter host $1's namespaces fresh (at `up`): network, then a private mount + UTS namespace with its
# hostname, /etc/hosts, /tmp and /dev/shm, keeping the --share folders under /tmp visible as they are.
host_shell() {
  local i=$1; shift
  local shares; shares=$(cat "$STATE/shares")
  exec unshare --mount --uts --propagation private nsenter --net="/run/netns/$NAME-h$i" \
    env SG_HOST="$NAME-$i" SG_STATE="$STATE" SG_SHARES="$shares" bash -c '
      set -e
      hostname "$SG_HOST"
      mount --bind "$SG_STATE/hosts" /etc/hosts
      hold="$SG_STATE/hold/$SG_HOST"; mkdir -p "$hold"
      mount --bind /tmp "$hold"
      mount -t tmpfs -o mode=1777 tmpfs /tmp
      for s in $SG_SHARES; do mkdir -p "$s"; mount --bind "$hold/${s#/tmp/}" "$s"; done
      mount -t tmpfs -o mode=1777 tmpfs /dev/shm
      exec "$@"' host "$@"
}

up() {
  local hosts=3 gpus=2 cpus=8 mem=16000 shares=()
  while (( $# )); do
    case $1 in
      --hosts) hosts=$2; shift 2 ;;
      --gpus) gpus=$2; shift 2 ;;
      --cpus) cpus=$2; shift 2 ;;
      --mem-mib) mem=$2; shift 2 ;;
      --share) shares+=("$(realpath -m "$2")"); shift 2 ;;
      *) die "up: unknown option $1" ;;
    esac
  done
  (( hosts >= 1 && hosts <= 50 )) || die "--hosts $hosts: 1..50"
  check
  [[ -e $STATE/run ]] && die "$STATE exists: a cluster named $NAME is up (run '$0 down' first)"
  local s
  for s in "${shares[@]}"; do
    [[ $s == /tmp/* && -d $s ]] || die "--share $s: a folder under /tmp (the rest of the file system is shared already)"
  done
  mkdir -p "$STATE"/{run,log,spool,ctld,hold,dev,munge,key}
  chmod 755 "$STATE/munge"; chmod 700 "$STATE/key"
  echo "${shares[*]}" > "$STATE/shares"

  # the network: a bridge in a namespace of its own, a veth from each host's namespace to it
  ip netns add "$NAME-sw"
  ip -n "$NAME-sw" link add br0 type bridge
  ip -n "$NAME-sw" link set br0 up
  ip -n "$NAME-sw" link set lo up
  printf '127.0.0.1 localhost\n' > "$STATE/hosts"
  local i
  for (( i = 0; i < hosts; i++ )); do
    ip netns add "$NAME-h$i"
    ip link add "$NAME-v$i" netns "$NAME-h$i" type veth peer name "p$i" netns "$NAME-sw"
    ip -n "$NAME-h$i" link set "$NAME-v$i" name eth0
    ip -n "$NAME-h$i" addr add "$SUBNET.$(( 10 + i ))/24" dev eth0
    ip -n "$NAME-h$i" link set eth0 up
    ip -n "$NAME-h$i" link set lo up
    ip -n "$NAME-sw" link set "p$i" master br0 up
    printf '%s %s\n' "$SUBNET.$(( 10 + i ))" "$NAME-$i" >> "$STATE/hosts"
    mkdir -p "$STATE/spool/$NAME-$i"
  done

  # munge: one key, one daemon; its socket is a file every host's mount namespace sees
  dd if=/dev/urandom of="$STATE/key/munge.key" bs=1024 count=1 status=none
  chmod 400 "$STATE/key/munge.key"
  munged --force --key-file="$STATE/key/munge.key" --socket="$STATE/munge/munge.socket" \
    --pid-file="$STATE/run/munged.pid" --log-file="$STATE/log/munged.log" --seed-file="$STATE/key/seed"

  # the stand-in GPUs: character devices numbered as NVIDIA's (Slurm tells them apart by number; nothing opens them)
  for (( i = 0; i < gpus; i++ )); do mknod -m 600 "$STATE/dev/gpu$i" c 195 "$i"; done
  local last=$(( hosts - 1 )) gpu_last=$(( gpus - 1 ))
  {
    echo "ClusterName=$NAME"
    echo "SlurmctldHost=$NAME-0($SUBNET.10)"
    echo "SlurmUser=root"
    echo "AuthType=auth/munge"
    echo "AuthInfo=socket=$STATE/munge/munge.socket"
    echo "CredType=cred/munge"
    echo "StateSaveLocation=$STATE/ctld"
    echo "SlurmdSpoolDir=$STATE/spool/%n"
    echo "SlurmctldPidFile=$STATE/run/slurmctld.pid"
    echo "SlurmdPidFile=$STATE/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$STATE/log/slurmctld.log"
    echo "SlurmdLogFile=$STATE/log/slurmd-%n.log"
    echo "SlurmdParameters=config_overrides"   # the configured CPUs/memory/GPUs, whatever the machine has
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core_Memory"
    echo "GresTypes=gpu"
    echo "MpiDefault=none"
    echo "ReturnToService=2"
    echo "SchedulerParameters=sched_interval=2"
    echo "MinJobAge=3600"
    echo "KillWait=30"
    echo "InactiveLimit=0"
    for (( i = 0; i < hosts; i++ )); do
      echo "NodeName=$NAME-$i NodeAddr=$SUBNET.$(( 10 + i )) CPUs=$cpus RealMemory=$mem Gres=gpu:$gpus State=UNKNOWN"
    done
    echo "PartitionName=main Nodes=$NAME-[0-$last] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } > "$STATE/slurm.conf"
  if (( gpus > 0 )); then
    echo "NodeName=$NAME-[0-$last] Name=gpu File=$STATE/dev/gpu[0-$gpu_last]" > "$STATE/gres.conf"
  else
    : > "$STATE/gres.conf"
  fi

  export SLURM_CONF=$STATE/slurm.conf
  host_shell 0 slurmctld -D -i -f "$STATE/slurm.conf" >> "$STATE/log/slurmctld.out" 2>&1 &
  for (( i = 0; i < hosts; i++ )); do
    host_shell "$i" slurmd -D -f "$STATE/slurm.conf" >> "$STATE/log/slurmd-$NAME-$i.out" 2>&1 &
    echo $! > "$STATE/run/slurmd-$i.pid"
  done
  # every node idle, or say why not
  local n
  for n in $(seq 120); do
    if out=$(host_shell 0 sinfo -h -N -o '%N %t' 2>/dev/null) && [[ $(grep -c ' idle$' <<< "$out") = "$hosts" ]]; then
      echo "local-slurm: $hosts host(s) up ($NAME-0..$NAME-$last, $gpus GPU(s), $cpus CPUs, $mem MiB each); state in $STATE"
      return 0
    fi
    sleep 0.5
  done
  echo "local-slurm: the nodes did not come up in 60 s: sinfo says: ${out:-nothing}; logs kept in $STATE/log" >&2
  STREAMGRPO_SLURM_KEEP=1 down
  exit 1
}

run_on() {
  local i=$1; shift
  local pid; pid=$(host_pid "$i")
  SLURM_CONF=$STATE/slurm.conf exec nsenter -t "$pid" -n -m -u --wd="$PWD" "$@"
}

down() {
  [[ -d $STATE ]] || { echo "local-slurm: nothing named $NAME is up"; return 0; }
  local pids="" f ns
  [[ -s $STATE/slurm.conf && -s $STATE/run/slurmd-0.pid ]] && \
    SLURM_CONF=$STATE/slurm.conf nsenter -t "$(cat "$STATE/run/slurmd-0.pid")" -n -m -u scancel --full --quiet \
      --state=PENDING,RUNNING,SUSPENDED --partition=main 2>/dev/null || true
  # every process in the hosts' network namespaces (daemons, job steps), then munged: by PID
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$NAME-(h[0-9]+|sw)$" || true); do
    pids+=" $(ip netns pids "$ns" | tr '\n' ' ')"
  done
  [[ -s $STATE/run/munged.pid ]] && pids+=" $(cat "$STATE/run/munged.pid")"
  for f in $pids; do kill -TERM "$f" 2>/dev/null || true; done
  for _ in $(seq 20); do
    local alive=0
    for f in $pids; do kill -0 "$f" 2>/dev/null && alive=1; done
    (( alive )) || break
    sleep 0.5
  done
  for f in $pids; do kill -KILL "$f" 2>/dev/null || true; done
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$NAME-(h[0-9]+|sw)$" || true); do ip netns del "$ns"; done
  # the state folder (logs too) goes unless asked to keep it; hold/ only ever held bind mounts of /tmp
  if [[ -n ${STREAMGRPO_SLURM_KEEP:-} ]]; then rm -rf "$STATE/run"; else rm -rf "$STATE"; fi
  echo "local-slurm: $NAME is down"
}

case ${1:-} in
  up) shift; up "$@" ;;
  down) down ;;
  check) check; echo "local-slurm: this machine can run a local Slurm" ;;
  exec) [[ $# -ge 3 ]] || die "usage: $0 exec HOST COMMAND..."; shift; run_on "$@" ;;
  *) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
