#!/usr/bin/env bash
# N maxtrain processes on this machine forming one JAX job: the multi-host code path, for real,
# on a laptop or a CI box (coordinator on 127.0.0.1, gloo collectives on CPU).
#
#   scripts/launch_local.sh [--dry-run] [--max-restarts K] N CONFIG.yml [key=value ...]
#
# --max-restarts K (torchrun's name): when a process fails, the others are stopped (SIGKILL: a job that
# lost a process cannot agree on a step to save) and the whole job starts again with the same command, at
# most K times, one line each; each start resumes from the run's newest checkpoint. Bad input (exit 2) and
# Ctrl-C (130) end the job: starting again would not help.
#
# Env: MAXTRAIN_DEVICES_PER_PROCESS (fake CPU devices per process, default 4),
#      MAXTRAIN_PLATFORM (default cpu), MAXTRAIN_COORDINATOR_PORT (default: a free port),
#      MAXTRAIN_LOG_DIR (where processes 1..N-1 write their output; default ./outputs/launch_local).
#      XLA_FLAGS is passed on, with each process's device count after it.
# Process 0 prints to this terminal. Exits non-zero if any process fails (after the last restart).
set -euo pipefail
dry_run=0
max_restarts=0
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0; fi
while [[ "${1:-}" == --* ]]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    --max-restarts)
      [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "$0: --max-restarts needs a count (0 or more), not '${2:-}'" >&2; exit 2; }
      max_restarts=$2; shift 2 ;;
    *) echo "$0: unknown option $1 (--dry-run, --max-restarts K)" >&2; exit 2 ;;
  esac
done
if [[ $# -lt 2 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 [--dry-run] [--max-restarts K] N CONFIG.yml [key=value ...]" >&2; exit 2
fi
n=$1; shift
# shellcheck source=scripts/python_env.sh
source "$(dirname "$0")/python_env.sh"
python=$PYTHON
port=${MAXTRAIN_COORDINATOR_PORT:-$($python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
devices=${MAXTRAIN_DEVICES_PER_PROCESS:-4}
platform=${MAXTRAIN_PLATFORM:-cpu}
log_dir=${MAXTRAIN_LOG_DIR:-outputs/launch_local}

# A terminal's Ctrl-C reaches every process of this group: each maxtrain process saves the step they agree
# on and stops; this script keeps waiting for them and exits with their status.
trap '' INT
start_job() {  # N processes, their pids in `pids`
  local i cmd
  pids=()
  for ((i = 0; i < n; i++)); do
    # The device count after the shell's XLA_FLAGS: the last of a flag wins.
    cmd=(env "XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$devices"
         "JAX_PLATFORMS=$platform"
         "$python" -m maxtrain.train "$@" "coordinator_address=127.0.0.1:$port" "num_processes=$n" "process_id=$i")
    if [[ $dry_run == 1 ]]; then
      printf '%q ' "${cmd[@]}"; echo
    elif [[ $i == 0 ]]; then
      "${cmd[@]}" & pids+=($!)
    else
      mkdir -p "$log_dir"
      "${cmd[@]}" >> "$log_dir/process_$i.log" 2>&1 & pids+=($!)
    fi
  done
}
wait_job() {  # sets status: the first failure's (the other processes are then stopped), else 0
  local running=("${pids[@]}") pid code i
  failed=""
  while ((${#running[@]} > 0)); do
    wait -n -p pid "${running[@]}" 2>/dev/null && code=0 || code=$?
    running=($(for p in "${running[@]}"; do [[ $p == "$pid" ]] || echo "$p"; done))
    if ((code != 0)) && [[ -z $failed ]]; then
      for ((i = 0; i < n; i++)); do [[ ${pids[$i]} == "$pid" ]] && failed="process $i exited with code $code"; done
      # to restart: stop the rest now (their peer is gone); else they stop themselves, each with its line
      ((max_restarts == 0 || ${#running[@]} == 0)) || kill -KILL "${running[@]}" 2>/dev/null || true
      status=$code
    fi
  done
}
restart=0
while true; do
  start_job "$@"
  [[ $dry_run == 1 ]] && exit 0
  status=0
  wait_job
  if ((status == 0 || status == 2 || status == 130)) || ((restart >= max_restarts)); then
    ((status == 0 || max_restarts == 0)) || echo "launch_local: $failed; no restart left (--max-restarts $max_restarts)" >&2
    exit $status
  fi
  restart=$((restart + 1))
  echo "launch_local: $failed; restart $restart of $max_restarts: the whole job starts again" >&2
done
