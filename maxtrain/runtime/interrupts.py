"""Ctrl-C (SIGINT) and SIGTERM for the training command: before the loop they end the process at once; in
the loop they are a preemption (save the step, stop, exit 0); during that save a second Ctrl-C says it is
still saving and a third one quits at once (exit 130), leaving the last complete checkpoint as it was.

A Python signal handler runs only when the main thread is back in the interpreter, which it is not while
XLA compiles or a save is waited for. So the CLI's signals are answered by a thread: Python's C-level
handler writes each signal's number to a pipe (signal.set_wakeup_fd) and the thread reads it at once.
Without the CLI (train() called from Python) the loop sets ordinary handlers for its own duration, and a
third Ctrl-C raises KeyboardInterrupt there instead of ending the process.

No jax here: the CLI installs this before anything slow is imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from maxtrain.runtime.errors import INTERRUPTED

NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class _State:
    watching = False      # the CLI's thread answers the signals
    in_loop = False       # a signal is a step to stop at, no longer the end of the start-up
    requested = None      # the first signal in the loop (SIGINT or SIGTERM)
    presses = 0           # Ctrl-Cs after the request
    multiprocess = False  # the request goes to JAX's preemption service (which listens for SIGTERM)
    printing = True       # this process prints progress (process 0)
    during = "start-up"   # what a signal before the loop interrupts
    last_step = 0         # the last step the loop asked about (Preemption.reached)
    stop_at = None        # one process: the step a request stops after (the next the loop asks about)


STATE = _State()


def _write(text: str, stream) -> None:
    stream.write(text + "\n")
    stream.flush()


def _quit(code: int, text: str, stream) -> None:
    sys.stdout.flush()
    _write(text, stream)
    os._exit(code)


def on_signal(signum: int) -> None:
    """What a SIGINT or SIGTERM does now (from the CLI's thread, or a handler during the loop)."""
    if not STATE.in_loop:
        if STATE.during != "start-up":  # another command's work (the AOT compile): nothing of it is kept
            what = "stopped by SIGTERM" if signum == signal.SIGTERM else "interrupted by Ctrl-C"
            _quit(INTERRUPTED if signum == signal.SIGINT else 128 + signal.SIGTERM,
                  f"{what} during {STATE.during}: nothing written", sys.stderr)
        if signum == signal.SIGTERM:
            _quit(0, "stopped by SIGTERM during start-up, before the first step: nothing to save", sys.stdout)
        _quit(INTERRUPTED, "interrupted by Ctrl-C during start-up, before the first step: nothing saved",
              sys.stderr)
    if STATE.requested is None:
        STATE.requested = signum
        if STATE.multiprocess and signum == signal.SIGINT:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption service agrees on the step with the peers
        STATE.stop_at = STATE.last_step + 1
        if STATE.printing:  # at once: the step under way may take minutes
            where = "at a step every process agrees on" if STATE.multiprocess else f"after step {STATE.stop_at}"
            again = " (Ctrl-C twice more to quit without saving)" if signum == signal.SIGINT else ""
            _write(f"{NAMES[signum]}: stopping {where}: saving it{again}", sys.stdout)
        return
    if signum != signal.SIGINT:  # a scheduler repeating its SIGTERM must not cut the save short
        return
    STATE.presses += 1
    if STATE.presses == 1:
        if STATE.printing:
            _write("still saving before stopping: press Ctrl-C again to quit now without that save (the last "
                   "complete checkpoint is kept)", sys.stdout)
        return
    if not STATE.watching:
        raise KeyboardInterrupt
    _quit(INTERRUPTED, "interrupted by a third Ctrl-C: quit before the save finished; the last complete "
          "checkpoint is kept", sys.stderr)


def _watch(fd: int) -> None:
    while True:
        for signum in os.read(fd, 64):
            if signum in NAMES:
                on_signal(signum)


def watch(during: str = "start-up") -> None:
    """The CLI, first thing (main thread): from now on SIGINT and SIGTERM are answered by a thread. `during`:
    what the command does before any loop (a signal then ends it in one line)."""
    STATE.during = during
    if STATE.watching:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    for signum in NAMES:
        signal.signal(signum, lambda *_: None)  # Python's handler does nothing: the thread does the work
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read,), daemon=True, name="maxtrain-signals").start()
    STATE.watching = True


def rearm() -> None:
    """After a library that installs its own handlers for these signals (libtpu's stack dump on SIGTERM):
    ours again, so a signal is still one line (the main thread)."""
    if STATE.watching:
        for signum in NAMES:
            signal.signal(signum, lambda *_: None)


def stop_watching() -> None:
    """A process that hands its signals on (the multi-process supervisor) answers none itself."""
    if STATE.watching:
        signal.set_wakeup_fd(-1)
        STATE.watching = False


class Preemption:
    """SIGTERM (what TPU, GKE and SLURM preemption send) or Ctrl-C as a step at which to save and stop.

    Before the loop a signal ends the process at once (no step, nothing to save). From the loop on, one
    process: the signal sets a request that the next step sees. Several processes: the signal may reach
    each at a different step, so JAX's preemption service (started by jax.distributed.initialize, with its
    own SIGTERM handler, which a Python handler would replace) agrees on one step for all; a Ctrl-C is
    turned into a SIGTERM to this process for it.
    """

    def __init__(self, step: int = 0):
        import jax
        self.multiprocess = jax.process_count() > 1
        STATE.in_loop, STATE.requested, STATE.presses, STATE.stop_at, STATE.last_step = True, None, 0, None, step
        STATE.multiprocess, STATE.printing = self.multiprocess, jax.process_index() == 0
        self._previous = {}
        if not STATE.watching:  # train() called from Python: handlers for the loop's duration
            kinds = (signal.SIGINT,) if self.multiprocess else (signal.SIGINT, signal.SIGTERM)
            self._previous = {s: signal.signal(s, lambda signum, frame: on_signal(signum)) for s in kinds}
        if self.multiprocess:
            from jax.experimental import multihost_utils
            self._sync_point = multihost_utils.reached_preemption_sync_point
        self.received = False

    @property
    def name(self) -> str:
        """The signal that stopped the run, as the last line names it."""
        return NAMES.get(STATE.requested, "SIGTERM")  # several processes: the peer's signal is not known here

    def reached(self, step: int) -> bool:
        """Call after every step (all processes, every step): True at the step to stop after."""
        if not self.received:
            if self.multiprocess:
                self.received = self._sync_point(step)
            else:
                self.received = STATE.requested is not None  # (the step after the request: STATE.stop_at)
            STATE.last_step = step
        return self.received

    def restore(self):
        """After the final save. The CLI's thread keeps answering: a Ctrl-C now still says it is saving."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        if not STATE.watching:
            STATE.in_loop = False
