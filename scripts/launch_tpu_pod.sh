#!/usr/bin/env bash
# Run maxtrain on every worker of a Cloud TPU VM pod slice: the same command on each host;
# jax.distributed auto-detects the pod (TPU_WORKER_HOSTNAMES), XLA SPMD does the rest.
#
#   scripts/launch_tpu_pod.sh [--dry-run] --tpu NAME --zone ZONE [--project P]
#       [--create --accelerator v5p-128 [--runtime v2-alpha-tpuv5] [--spot]] [--max-restarts K]
#       -- CONFIG.yml [key=value ...]
#
# Steps: (optionally) create a queued resource and wait until ACTIVE; copy this checkout to every
# worker (git archive, so only tracked files); pip install -e .[tpu]; run the training command.
# --max-restarts K: when the training command fails on a worker, maxtrain is stopped on every worker and
# the command runs again, at most K times, resuming from the newest checkpoint (exit 2, bad input, and 130,
# Ctrl-C, end it). --dry-run prints the commands instead of running them.
set -euo pipefail
dry_run=0 create=0 spot="" tpu="" zone="" project="" accelerator="" runtime="v2-alpha-tpuv5" max_restarts=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;  # the comment above, as the usage
    --dry-run) dry_run=1; shift ;;
    --tpu) tpu=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --project) project=$2; shift 2 ;;
    --create) create=1; shift ;;
    --accelerator) accelerator=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --spot) spot="--spot"; shift ;;
    --max-restarts)
      [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "--max-restarts needs a count (0 or more), not '${2:-}'" >&2; exit 2; }
      max_restarts=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (training arguments go after --)" >&2; exit 2 ;;
  esac
done
if [[ -z $tpu || -z $zone || $# -lt 1 ]]; then
  echo "usage: $0 [--dry-run] --tpu NAME --zone ZONE [--project P] [--create --accelerator TYPE] -- CONFIG.yml [key=value ...]" >&2
  exit 2
fi
if [[ $create == 1 && -z $accelerator ]]; then echo "--create needs --accelerator (e.g. v5p-128)" >&2; exit 2; fi
project_flag=()
[[ -n $project ]] && project_flag=(--project "$project")

run() { if [[ $dry_run == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi; }

if [[ $create == 1 ]]; then
  run gcloud compute tpus queued-resources create "$tpu" --node-id "$tpu" --zone "$zone" \
    --accelerator-type "$accelerator" --runtime-version "$runtime" ${spot:+"$spot"} "${project_flag[@]}"
  if [[ $dry_run == 0 ]]; then
    until gcloud compute tpus queued-resources describe "$tpu" --zone "$zone" "${project_flag[@]}" \
        --format='value(state.state)' | grep -q ACTIVE; do sleep 30; done
  fi
fi

archive=${TMPDIR:-/tmp}/maxtrain-$$.tar.gz
run git archive --format=tar.gz -o "$archive" HEAD
run gcloud compute tpus tpu-vm scp "$archive" "$tpu:~/maxtrain.tar.gz" --worker=all --zone "$zone" "${project_flag[@]}"
train_cmd="python -m maxtrain.train $(printf '%q ' "$@")"
train_cmd=${train_cmd% }
remote="mkdir -p ~/maxtrain && tar -xzf ~/maxtrain.tar.gz -C ~/maxtrain && cd ~/maxtrain && pip install -q -e '.[tpu]' && $train_cmd"
ssh_all() { gcloud compute tpus tpu-vm ssh "$tpu" --worker=all --zone "$zone" "${project_flag[@]}" --command "$1"; }
if [[ $dry_run == 1 ]]; then run gcloud compute tpus tpu-vm ssh "$tpu" --worker=all --zone "$zone" "${project_flag[@]}" --command "$remote"; exit 0; fi
for ((restart = 0; ; restart++)); do
  status=0
  ssh_all "$remote" || status=$?
  if ((status == 0 || status == 2 || status == 130 || restart >= max_restarts)); then exit $status; fi
  echo "launch_tpu_pod: the training command failed (code $status); restart $((restart + 1)) of $max_restarts" >&2
  ssh_all "pkill -9 -f [m]axtrain.train || true"  # the workers whose peer went away ([m]: not this shell)
  remote="cd ~/maxtrain && $train_cmd"
done
