"""What a run is doing while it prints nothing else: a heartbeat line during long phases (compiling,
restoring, evaluating, saving), its durations as people read them (runtime/wording.py)."""

from __future__ import annotations

import threading
import time

import jax

from maxtrain.runtime.wording import duration

HEARTBEAT_SECONDS = 30.0  # a line at least this often while a long phase runs


class heartbeat:
    """`with heartbeat("compiling the train step"):` prints `still compiling the train step (1m 30s)` every
    HEARTBEAT_SECONDS until the block ends, from a daemon thread (process 0 only). `what` may be changed
    inside the block as the phase moves on. Nothing runs on the training step's path: the thread sleeps on an
    event that the block's end sets."""

    def __init__(self, what: str, since: float | None = None):
        self.what = what
        self._since = since
        self._period = HEARTBEAT_SECONDS
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> "heartbeat":
        self._since = time.perf_counter() if self._since is None else self._since
        if jax.process_index() == 0:
            self._thread = threading.Thread(target=self._beat, name="maxtrain-heartbeat", daemon=True)
            self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self._period):
            print(f"still {self.what} ({duration(time.perf_counter() - self._since)})", flush=True)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def timed(fn, *args):
    """`(fn(*args), seconds it took)`: a phase on a thread that reports its own duration."""
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0
