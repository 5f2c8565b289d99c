"""Multi-process start-up through JAX's own runtime (jax.distributed), and leaving it in one line.

Every host runs the same command. JAX's coordination service connects the processes, detects a dead
one by missed heartbeats, and XLA SPMD does the rest. Must run before anything touches devices. The
command's process supervises the training process (see supervise) so that a lost peer is one line.
"""

from __future__ import annotations

import collections
import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import jax

from maxtrain.runtime import errors, pathways
from maxtrain.config.load import Config

# Environment variables by which the cluster says this is one of several processes.
_CLUSTER_HINTS = (
    ("SLURM_NTASKS", lambda v: int(v) > 1),                          # SLURM srun
    ("TPU_WORKER_HOSTNAMES", lambda v: "," in v),                    # Cloud TPU pod slice
    ("MEGASCALE_NUM_SLICES", lambda v: int(v) > 1),                  # TPU multislice
    ("JOBSET_NAME", lambda v: bool(v)),                              # GKE JobSet
    ("JAX_COORDINATOR_ADDRESS", lambda v: bool(v)),
)


def _cluster_detected() -> bool:
    for name, test in _CLUSTER_HINTS:
        value = os.environ.get(name)
        try:
            if value is not None and test(value):
                return True
        except ValueError:
            continue
    return False


def wanted(c: Config) -> bool:
    if pathways.used():  # one controller process drives the whole job
        return False
    if c.distributed_init == "auto":
        return bool(c.coordinator_address) or _cluster_detected()
    return c.distributed_init == "true"


def initialize(c: Config) -> None:
    """jax.distributed.initialize() when the run is multi-process; under Pathways its own start-up instead
    (maxtrain.runtime.pathways); a no-op otherwise."""
    if pathways.initialize() or not wanted(c) or jax.distributed.is_initialized():
        return
    # CPU processes need a collectives implementation; this setting only affects the CPU backend.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {"heartbeat_timeout_seconds": c.distributed_heartbeat_timeout_seconds}
    if c.coordinator_address:  # explicit; otherwise JAX auto-detects Cloud TPU / SLURM / GKE
        kwargs.update(coordinator_address=c.coordinator_address)
    if c.num_processes > 0:
        kwargs.update(num_processes=c.num_processes)
    if c.process_id >= 0:
        kwargs.update(process_id=c.process_id)
    jax.distributed.initialize(**kwargs)


# ---- a peer that goes away: one line, not a native abort ----------------------------------------------
#
# When a peer dies or hangs, JAX's coordination service notices its missing heartbeats and every other
# process's client aborts (SIGABRT, a C++ check failure and its stack trace: jax offers no way to handle
# it, and a Python missed_heartbeat_callback dies in the binding with std::bad_cast), or first fails a
# collective (gloo: "Connection closed by peer") and then aborts the same way at exit. So a
# multi-process run trains in a child of the command's process: the parent passes the child's output
# through and, when the child ends that way, replaces the native noise by one line naming the process
# that went away (from the service's own message) and the last checkpoint, exit code 1.

_CHILD_ENV = "MAXTRAIN_SUPERVISED"
_ABSL_LINE = re.compile(rb"^[EFW]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")  # native WARNING, ERROR or FATAL
_ONE_LINE = re.compile(rb"^[a-z]+ error: ")  # errors.exit_code's
_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\n((?:\d+\n)+)")
_TIMED_OUT = re.compile(r"Task (\d+) heartbeat timeout")
_LEADER = "the leader task was preempted/died/restarted"
# gloo's error when a peer's socket closes mid-collective, thrown on its own thread: std::terminate prints
# "terminate called after throwing an instance of 'gloo::EnforceNotMet'" and aborts, at times before the
# coordination service has missed any heartbeat (seen on a loaded machine)
_TERMINATE = b"terminate called after throwing"
_GLOO_WHAT = re.compile(r"terminate called after throwing an instance of 'gloo::\w+'\n\s*what\(\):\s*(.*)")
_PEER_CLOSED = ("Connection closed by peer", "Connection reset by peer")
# A peer killed mid-send: gloo reads a cut message and asks "Is there a distributed collective mismatch in
# your code?". maxtrain's collectives are one compiled program on every process, so they cannot mismatch.
_PEER_CUT = ("op.preamble.length <= op.nbytes", "collective mismatch")
WARNING_DELAY_S = 5.0


def supervise(argv: list[str]) -> None:
    """In the command's process of a multi-process run: runs the training in a child and exits with its
    exit code (or 1, with one line, when the job lost a process). Returns at once in the child, in a
    single-process run, and on a config the child itself will refuse (it reports it)."""
    if os.environ.get(_CHILD_ENV) or not argv or argv[0].startswith("-"):
        return
    from maxtrain.config import load as config_lib
    try:
        c = config_lib.load(argv)
    except Exception:
        return
    if not wanted(c):
        return
    sys.exit(_run_child(c))


def _die_with_parent() -> None:
    """The child ends with its parent (even a SIGKILLed one), so the peers see this process go away."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_child(c: Config) -> int:
    from maxtrain.observe import goodput  # the child's start-up began with this process
    env = {**os.environ, _CHILD_ENV: "1", goodput.STARTED_ENV: str(goodput.process_start())}
    child = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env=env,
                             stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_die_with_parent)
    # Signals reach the child through here only (it has a session of its own, so a terminal's Ctrl-C, sent to
    # the whole foreground group, reaches this process alone): once each. The child turns a Ctrl-C into a
    # preemption that JAX's service agrees on with the peers (interrupts.py).
    from maxtrain.runtime import interrupts
    interrupts.stop_watching()  # this process answers no signal itself: it hands each on
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in iter(child.stderr.readline, b"")] + [lines.put(None)],
                     daemon=True).start()
    # From the first native error or traceback on, everything is held (shown if the child ends normally). A
    # native warning waits a few seconds first: a peer's death often starts with one, then the abort follows.
    held: collections.deque[bytes] = collections.deque(maxlen=2000)
    waiting: list[tuple[float, bytes]] = []
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            line = b""
        if line is None:
            break
        if line and held:
            held.append(line)
            continue
        if line:
            native = (_ABSL_LINE.match(line) or line.startswith(b"Traceback (most recent call last)")
                      or line.startswith(_TERMINATE))
            if native and line[:1] != b"W":
                held.extend(x for _, x in waiting)
                held.append(line)
                waiting.clear()
                continue
            if native or waiting:  # a warning, or anything after one: wait and see
                waiting.append((time.monotonic(), line))
                line = b""
        while waiting and time.monotonic() - waiting[0][0] > WARNING_DELAY_S:
            sys.stderr.buffer.write(waiting.pop(0)[1])
        sys.stderr.buffer.write(line)
        sys.stderr.flush()
    held.extend(x for _, x in waiting)
    code = child.wait()
    text = b"".join(held).decode(errors="replace")
    if code in (0, 1, 2, errors.INTERRUPTED) and "Terminating process because" not in text:
        mine = [x for x in held if _ONE_LINE.match(x)]  # a one-line error after the peers' noise
        sys.stderr.buffer.write(b"".join(mine if code and mine else held))
        sys.stderr.flush()
        return code
    went_away = _who_went_away(c, text, code)
    if "ended abnormally" in went_away:  # no peer to blame: its own last words matter
        sys.stderr.buffer.write(b"".join(list(held)[-50:]))
    print(f"run error: {went_away}; {_last_checkpoint(c)}", file=sys.stderr, flush=True)
    return 1


def _who_went_away(c: Config, text: str, code: int) -> str:
    n = f" of {c.num_processes}" if c.num_processes > 0 else ""
    timeout = f"no heartbeat for distributed_heartbeat_timeout_seconds={c.distributed_heartbeat_timeout_seconds}"
    tasks = sorted({int(t) for m in _UNHEALTHY.finditer(text) for t in m.group(1).split()} |
                   {int(t) for t in _TIMED_OUT.findall(text)})
    if tasks:
        which = ", ".join(map(str, tasks))
        return f"process{'es' if len(tasks) > 1 else ''} {which}{n} went away ({timeout}): this process stopped too"
    if _LEADER in text:
        return f"process 0{n} (the coordinator) went away: this process stopped too"
    gloo = _GLOO_WHAT.search(text)
    who = f"process {1 - c.process_id}{n}" if c.num_processes == 2 and c.process_id in (0, 1) else "a peer"
    if gloo and any(x in gloo.group(1) for x in _PEER_CLOSED):  # the service had not noticed yet
        return f"{who} went away (its connection closed during a collective): this process stopped too"
    if gloo and any(x in gloo.group(1) for x in _PEER_CUT):
        return f"{who} went away (a collective's message from it was cut short): this process stopped too"
    if gloo:  # any other failure of a collective: gloo's own words
        return f"a collective failed (gloo: {gloo.group(1).strip()}): this process stopped too"
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return f"this process ({c.process_id if c.process_id >= 0 else '?'}{n}) ended abnormally ({how})"


def _last_checkpoint(c: Config) -> str:
    if not c.enable_checkpointing:
        return "checkpointing is off"
    from maxtrain.runtime import storage
    directory = storage.absolute(c.base_output_directory) / c.run_name / "checkpoints"
    try:
        steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()]
    except Exception:  # a local OSError, or an object store's own error types
        steps = []
    from maxtrain.checkpoint.trust import Trust
    trusted = Trust(directory, 0.0).newest_trusted(steps)
    if trusted is not None:
        return f"last trusted checkpoint: step {trusted} in {directory}"
    return f"last checkpoint: step {max(steps)} in {directory} (not yet verified)" if steps else "no checkpoint"


def leave_on_error(code: int) -> None:
    """A process that stopped with a one-line error, before it exits: when its peers stopped with the
    same error (a config or data error every process finds), all of them leave together and cleanly;
    one that leaves first would take the coordination service (process 0) or its heartbeats away, and
    the others would abort natively before they print their own line. Peers still running: leave now."""
    if not code or not jax.distributed.is_initialized():
        return
    from jax._src import distributed as jax_distributed
    try:
        jax_distributed.global_state.client.wait_at_barrier("maxtrain_leave_on_error", 10_000)
        jax.distributed.shutdown()
    except Exception:  # a peer is still running (or gone): it reports this process as gone
        pass
