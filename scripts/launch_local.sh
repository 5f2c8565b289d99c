#!/usr/bin/env bash
# N maxtrain processes on this machine forming one JAX job: the multi-host code path, for real,
# on a laptop or a CI box (coordinator on 127.0.0.1, gloo collectives on CPU).
#
#   scripts/launch_local.sh [--dry-run] N CONFIG.yml [key=value ...]
#
# Env: MAXTRAIN_DEVICES_PER_PROCESS (fake CPU devices per process, default 4),
#      MAXTRAIN_PLATFORM (default cpu), MAXTRAIN_COORDINATOR_PORT (default: a free port),
#      MAXTRAIN_LOG_DIR (where processes 1..N-1 write their output; default ./outputs/launch_local).
#      XLA_FLAGS is passed on, with each process's device count after it.
# Process 0 prints to this terminal. Exits non-zero if any process fails.
set -euo pipefail
dry_run=0
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0; fi
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
if [[ $# -lt 2 ]]; then
  echo "usage: $0 [--dry-run] N CONFIG.yml [key=value ...]" >&2; exit 2
fi
n=$1; shift
python=${PYTHON:-python}
port=${MAXTRAIN_COORDINATOR_PORT:-$($python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
devices=${MAXTRAIN_DEVICES_PER_PROCESS:-4}
platform=${MAXTRAIN_PLATFORM:-cpu}
log_dir=${MAXTRAIN_LOG_DIR:-outputs/launch_local}

# A terminal's Ctrl-C reaches every process of this group: each maxtrain process saves the step they agree
# on and stops; this script keeps waiting for them and exits with their status.
trap '' INT
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
    "${cmd[@]}" > "$log_dir/process_$i.log" 2>&1 & pids+=($!)
  fi
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
