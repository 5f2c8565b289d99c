#!/usr/bin/env bash
# Run maxtrain on Cloud TPU VM slices: the same command on every worker, detached, a log per worker.
#
#   scripts/launch_tpu_pod.sh [start] [--dry-run] --tpu NAME --zone ZONE [--project P] [--num-slices N]
#       [--create --accelerator v5p-128 [--runtime VERSION] [--spot]] [--env KEY=VALUE ...]
#       [--extras tpu,gcs] [--max-restarts K] [--restart-delay S] -- CONFIG.yml [key=value ...]
#   scripts/launch_tpu_pod.sh logs   --tpu NAME --zone ZONE [--worker N] [--slice I] [--follow]
#   scripts/launch_tpu_pod.sh status --tpu NAME --zone ZONE
#   scripts/launch_tpu_pod.sh stop   --tpu NAME --zone ZONE
#
# start checks the config here (outputs and data must be on gs://), ships the checkout's tracked files and
# the config files the command names to every worker, makes each worker's Python 3.12 environment with uv
# (again only when pyproject.toml or the extras change), and starts training detached: it runs on when
# this machine goes away. --num-slices N: slices NAME-0 ... NAME-(N-1) (with --create, one queued
# resource of N nodes), joined through MEGASCALE_* variables. --dry-run prints each command instead.
# The worker's side: scripts/tpu_worker.sh. Details: docs/scaling.md.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
# shellcheck source=scripts/python_env.sh
source "$(dirname "$0")/python_env.sh"
exec "$PYTHON" -m maxtrain.launch.tpu_pod "$@"
