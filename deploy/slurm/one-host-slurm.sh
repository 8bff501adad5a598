#!/bin/bash
# A one-host Slurm cluster in a directory of its own, for trying deploy/slurm/job.sbatch and
# kvstore-launch --launcher slurm on one machine (the test suite uses it too). Needs Slurm and
# MUNGE installed (Debian/Ubuntu: apt-get install slurm-wlm munge) and root, as slurmd does.
#
#   deploy/slurm/one-host-slurm.sh start DIR     # writes DIR/slurm.conf, starts munged,
#                                                #   slurmctld and slurmd, waits for the node
#   export SLURM_CONF=DIR/slurm.conf             # then sbatch, srun, squeue use this cluster
#   sbatch --nodes=1 --wait deploy/slurm/job.sbatch --epochs 1
#   deploy/slurm/one-host-slurm.sh stop DIR      # stops the three daemons by their pid files
#
# The node is this host, with all its CPUs, under its own name (`hostname`), at 127.0.0.1; the
# daemons use free TCP ports and a MUNGE socket inside DIR, so they leave any other Slurm or
# MUNGE on the machine alone, and several such clusters can run at once.
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)

stop() {
    local name pid
    for name in slurmd slurmctld munged; do
        if [ -f "$dir/$name.pid" ]; then
            pid=$(cat "$dir/$name.pid")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
            rm -f "$dir/$name.pid"
        fi
    done
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
    for tool in munged slurmctld slurmd sinfo; do
        command -v "$tool" >/dev/null || { echo "$0: $tool is not installed" >&2; exit 3; }
    done
    [ "$(id -u)" -eq 0 ] || { echo "$0: slurmd runs as root; run this as root" >&2; exit 3; }
    mkdir -p "$dir/state" "$dir/spool" "$dir/log"
    local node cpus
    node=$(hostname)
    cpus=$(nproc --all)
    cat > "$dir/slurm.conf" <<CONF
ClusterName=onehost
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    if [ ! -f /etc/munge/munge.key ] && [ ! -f "$dir/munge.key" ]; then
        head -c 1024 /dev/urandom > "$dir/munge.key"
        chmod 400 "$dir/munge.key"
    fi
    local key=/etc/munge/munge.key
    [ -f "$dir/munge.key" ] && key=$dir/munge.key
    munged --socket="$dir/munge.socket" --key-file="$key" --pid-file="$dir/munged.pid" \
        --log-file="$dir/log/munged.log" --seed-file="$dir/munge.seed" --force
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF"
    for _ in $(seq 100); do
        if [ "$(sinfo -h -o %t 2>/dev/null)" = "idle" ]; then
            echo "one-host Slurm up: export SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.2
    done
    echo "$0: the node did not become idle; logs in $dir/log" >&2
    sinfo >&2 || true
    stop
    exit 1
}

case $action in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
