#!/usr/bin/env bash
# One TPU VM worker's side of scripts/launch_tpu_pod.sh (which copies this script and the code archive to
# every worker's home directory and runs it there over gcloud ssh). Its state is under $MAXTRAIN_HOME
# (default ~/maxtrain): code/ (the archive unpacked), venv/ (Python >= 3.12 with maxtrain installed), run/
# (worker.log, pid, exit_code, the command).
#
#   tpu_worker.sh start --archive maxtrain-HASH.tar.gz [--extras tpu] [--max-restarts K] [--restart-delay S]
#                       [--env KEY=VALUE ...] -- CONFIG.yml [key=value ...]
#   tpu_worker.sh status | logs [--follow] | stop
#
# start: unpacks the code; makes a venv with a Python >= 3.12: $MAXTRAIN_PYTHON, else one on PATH, else uv's
# CPython 3.12 (`uv python install 3.12`, a download; TPU VM images have 3.10; uv itself is pip-installed for
# the user where missing); installs maxtrain[EXTRAS] into it (~1 min for [tpu]), again only when
# pyproject.toml or the extras changed; then starts
# training detached (setsid nohup: it runs on when the ssh session ends), output to run/worker.log. A
# failed run starts again after S seconds (every worker's process stops when a peer goes away), at most K
# times; exit 2 (bad input) and 130 (interrupted) are not retried. stop: SIGTERM (the run saves a checkpoint
# and stops), SIGKILL after 120 s.
set -euo pipefail
home=${MAXTRAIN_HOME:-$HOME/maxtrain}
code=$home/code venv=$home/venv run=$home/run
UV_VERSION=0.13.9

say() { echo "tpu_worker $(hostname): $*"; }
running() { [[ -f $run/pid ]] && kill -0 "$(cat "$run/pid")" 2>/dev/null; }

new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

find_python() {  # $MAXTRAIN_PYTHON, or a Python >= 3.12 on PATH, or uv's CPython 3.12 (fetched once)
  local p uv
  if [[ -n ${MAXTRAIN_PYTHON:-} ]]; then echo "$MAXTRAIN_PYTHON"; return; fi
  for p in python3.12 python3.13 python3; do
    if command -v "$p" > /dev/null && new_enough "$p"; then command -v "$p"; return; fi
  done
  uv=$(command -v uv || echo "$HOME/.local/bin/uv")
  [[ -x $uv ]] || python3 -m pip install --user --quiet "uv==$UV_VERSION" >&2
  "$uv" python find 3.12 2>/dev/null || { "$uv" python install 3.12 >&2 && "$uv" python find 3.12; }
}

setup() {  # archive extras
  local archive=$1 extras=$2 want
  [[ -f $archive ]] || { say "no archive $archive"; exit 2; }
  rm -rf "$code.new" && mkdir -p "$code.new" && tar -xzf "$archive" -C "$code.new"
  rm -rf "$code" && mv "$code.new" "$code"
  want="$(sha256sum "$code/pyproject.toml" | cut -c1-16) [$extras]"
  if [[ -x $venv/bin/python && "$(cat "$venv/.maxtrain-installed" 2>/dev/null)" == "$want" ]]; then
    say "environment $venv is up to date ($want)"; return
  fi
  local t0=$SECONDS python
  if [[ ! -x $venv/bin/python ]]; then
    python=$(find_python)
    "$python" -m venv "$venv"
  fi
  new_enough "$venv/bin/python" \
    || { say "$venv has $("$venv/bin/python" -V); maxtrain needs Python 3.12 or newer: remove $venv"; exit 2; }
  # --no-compile: modules are compiled as they are first imported, not every file of every package (about half the time)
  "$venv/bin/python" -m pip install --quiet --no-compile -e "$code[$extras]"
  echo "$want" > "$venv/.maxtrain-installed"
  say "installed maxtrain[$extras] into $venv in $((SECONDS - t0)) s"
}

supervise() {  # runs detached: the training command, again after a failure while restarts are left
  local max_restarts delay restart=0 rc=0 stopping=0
  trap 'stopping=1' TERM  # stop: the run (same process group) saves and exits; then no restart
  read -r max_restarts delay < "$run/restarts"
  local -a env args
  mapfile -t env < "$run/env"
  mapfile -d '' -t args < "$run/args"
  while true; do
    rc=0
    (cd "$code" && exec env ${env[@]+"${env[@]}"} "$venv/bin/python" -m maxtrain.train "${args[@]}") || rc=$?
    echo "$rc" > "$run/exit_code"
    if ((stopping || rc == 0 || rc == 2 || rc == 130 || restart >= max_restarts)); then break; fi
    restart=$((restart + 1))
    say "the training command exited with code $rc; restart $restart of $max_restarts in $delay s"
    sleep "$delay"
    ((stopping)) && break
  done
  say "done: exit code $rc"
}

cmd=${1:-}; shift || true
case $cmd in
  -h|--help|"") sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
  start)
    archive="" extras=tpu max_restarts=0 delay=60 env=()
    while [[ $# -gt 0 ]]; do
      case $1 in
        --archive=*) archive=${1#*=} ;;
        --extras=*) extras=${1#*=} ;;
        --max-restarts=*) max_restarts=${1#*=} ;;
        --restart-delay=*) delay=${1#*=} ;;
        --env=*) env+=("${1#*=}") ;;
        --) shift; break ;;
        *) say "unknown option $1"; exit 2 ;;
      esac
      shift
    done
    [[ $# -ge 1 ]] || { say "the training arguments go after --"; exit 2; }
    if running; then say "a run is already going (pid $(cat "$run/pid")): stop it first"; exit 2; fi
    setup "$archive" "$extras"
    mkdir -p "$run"
    printf '%s\n' ${env[@]+"${env[@]}"} > "$run/env"
    printf '%s\0' "$@" > "$run/args"
    echo "$max_restarts $delay" > "$run/restarts"
    rm -f "$run/exit_code"
    setsid nohup bash "$0" supervise >> "$run/worker.log" 2>&1 < /dev/null &
    echo $! > "$run/pid"
    say "started (pid $!); log: $run/worker.log" ;;
  supervise) supervise ;;
  status)
    if running; then say "running (pid $(cat "$run/pid"))"
    elif [[ -f $run/exit_code ]]; then say "stopped: exit code $(cat "$run/exit_code")"
    else say "no run"; fi ;;
  logs)
    [[ -f $run/worker.log ]] || { say "no log yet ($run/worker.log)"; exit 1; }
    if [[ ${1:-} == --follow ]]; then tail -n 50 -F "$run/worker.log"; else tail -n 50 "$run/worker.log"; fi ;;
  stop)
    if ! running; then say "not running"; exit 0; fi
    pid=$(cat "$run/pid")
    kill -TERM -- "-$pid" 2>/dev/null || true  # setsid: the supervisor leads its own process group
    for _ in $(seq 120); do running || break; sleep 1; done
    if running; then kill -KILL -- "-$pid" 2>/dev/null || true; say "killed (no exit within 120 s)"; else say "stopped"; fi ;;
  *) say "unknown command $cmd (start, status, logs, stop)"; exit 2 ;;
esac
