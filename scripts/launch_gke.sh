#!/usr/bin/env bash
# GKE: run maxtrain on TPU slices, either through xpk or as a JobSet rendered from
# scripts/gke_jobset.yaml.tmpl and applied with kubectl. The image is built from the Dockerfile.
#
#   scripts/launch_gke.sh [--dry-run] [--xpk] --cluster C --workload NAME --tpu-type v5p-128 \
#       --image IMAGE [--num-slices N] [--max-restarts R] -- CONFIG.yml [key=value ...]
#
# --dry-run prints the xpk command, or the rendered manifest and the kubectl command.
set -euo pipefail
dry_run=0 xpk=0 cluster="" workload="" tpu_type="" image="" num_slices=1 max_restarts=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;  # the comment above, as the usage
    --dry-run) dry_run=1; shift ;;
    --xpk) xpk=1; shift ;;
    --cluster) cluster=$2; shift 2 ;;
    --workload) workload=$2; shift 2 ;;
    --tpu-type) tpu_type=$2; shift 2 ;;
    --image) image=$2; shift 2 ;;
    --num-slices) num_slices=$2; shift 2 ;;
    --max-restarts) max_restarts=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (training arguments go after --)" >&2; exit 2 ;;
  esac
done
if [[ -z $workload || -z $tpu_type || -z $image || $# -lt 1 ]]; then
  echo "usage: $0 [--dry-run] [--xpk] --cluster C --workload NAME --tpu-type v5p-128 --image IMAGE [--num-slices N] -- CONFIG.yml [key=value ...]" >&2
  exit 2
fi
# shellcheck source=scripts/python_env.sh
source "$(dirname "$0")/python_env.sh"  # the helper steps below import maxtrain here
train_cmd="python -m maxtrain.train $(printf '%q ' "$@")"  # in the image
train_cmd=${train_cmd% }

if [[ $xpk == 1 ]]; then
  cmd=(xpk workload create --cluster "$cluster" --workload "$workload" --tpu-type "$tpu_type"
       --num-slices "$num_slices" --docker-image "$image" --command "$train_cmd")
  if [[ $dry_run == 1 ]]; then printf '%q ' "${cmd[@]}"; echo; else "${cmd[@]}"; fi
  exit 0
fi

# TPU type -> GKE accelerator label, chips, topology and hosts (multi-host slices have 4 chips per host).
gen=${tpu_type%-*} n=${tpu_type##*-}
case $gen in
  v4)  accel=tpu-v4-podslice;     chips=$((n / 2)); per_host=4 ;;
  v5p) accel=tpu-v5p-slice;       chips=$((n / 2)); per_host=4 ;;
  v5e) accel=tpu-v5-lite-podslice; chips=$n;       per_host=$(( n <= 8 ? n : 4 )) ;;
  v6e) accel=tpu-v6e-slice;       chips=$n;        per_host=$(( n <= 8 ? n : 4 )) ;;
  *) echo "unsupported --tpu-type $tpu_type (v4-N, v5p-N, v5e-N, v6e-N)" >&2; exit 2 ;;
esac
topology=$("$PYTHON" -c "from maxtrain.compile import topology; print(topology('$tpu_type')[1].split(':')[1])")
manifest=$(WORKLOAD=$workload MAX_RESTARTS=$max_restarts NUM_SLICES=$num_slices HOSTS_PER_SLICE=$((chips / per_host)) \
  GKE_ACCELERATOR=$accel TOPOLOGY=$topology IMAGE=$image COMMAND=${train_cmd//\"/\\\"} CHIPS_PER_HOST=$per_host \
  "$PYTHON" -c 'import os, string, sys; print(string.Template(open(sys.argv[1]).read()).substitute(os.environ))' \
  "$(dirname "$0")/gke_jobset.yaml.tmpl")
if [[ $dry_run == 1 ]]; then
  echo "$manifest"; echo "---"; echo "kubectl apply -f -"
else
  echo "$manifest" | kubectl apply -f -
fi
