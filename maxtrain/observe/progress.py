"""What a run is doing while it prints nothing else: a heartbeat line during long phases (compiling,
restoring, evaluating, saving) and durations as people read them (1m 05s)."""

from __future__ import annotations

import threading
import time

import jax

HEARTBEAT_SECONDS = 30.0  # a line at least this often while a long phase runs


def counted(n: int, what: str) -> str:
    """`1 file`, `1,024 files`."""
    return f"{n:,} {what}{'s' * (n != 1)}"


def duration(seconds: float) -> str:
    """`45s`, `1m 05s`, `2h 03m`."""
    s = max(int(seconds), 0)  # elapsed time: whole seconds passed
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


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
