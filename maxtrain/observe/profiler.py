"""A jax.profiler trace of chosen steps (`profiler: xplane`), for XProf (the `profile` extra).

The trace covers steps profiler_start_step .. profiler_start_step + profiler_steps - 1 (absolute step
numbers, so a resumed run profiles the same steps or none) and lands in <run>/profile/plugins/profile/
<timestamp>/<host>.xplane.pb; every process writes its own host's file.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax

from maxtrain.runtime import storage
from maxtrain.config.load import Config


class StepProfiler:
    def __init__(self, c: Config, run_dir: Path):
        self.enabled = c.profiler == "xplane"
        self.first, self.last = c.profiler_start_step, c.profiler_start_step + c.profiler_steps - 1
        self.directory = run_dir / "profile"
        self.active = False
        self.seen = self.first  # the last step dispatched: a run may end inside the traced steps

    def before_step(self, step: int) -> None:
        """Call before dispatching step `step` (1-based, the step the state will be at after it)."""
        if self.enabled and step == self.first and not self.active:
            # jax's profiler writes local files: a URL run directory gets them when the trace ends
            url = storage.is_url(self.directory)
            self._local = Path(tempfile.mkdtemp(prefix="maxtrain-profile-")) if url else None
            jax.profiler.start_trace(str(self._local or self.directory))
            self.active = True

    def after_step(self, step: int, state) -> None:
        """Call after dispatching step `step`: past the last profiled step, wait for it and write the trace."""
        self.seen = step
        if self.active and step >= self.last:
            self.stop(state)

    def abandon(self) -> None:
        """A run that failed inside the traced steps: the trace ends (what it holds is written, quietly), so
        the process can trace again."""
        if not self.active:
            return
        self.active = False
        try:
            jax.profiler.stop_trace()
            if self._local is not None:
                storage.upload_tree(self._local, self.directory)
                storage.rmtree(self._local)
        except Exception:  # the run is already stopping for the error at hand
            pass

    def stop(self, state=None) -> None:
        if self.active:
            jax.block_until_ready(state)  # the trace must hold the profiled steps' device work
            before = set(self.directory.glob("plugins/profile/*"))
            jax.profiler.stop_trace()
            self.active = False
            if self._local is not None:
                storage.upload_tree(self._local, self.directory)
                storage.rmtree(self._local)
            if jax.process_index() == 0:
                written = sorted(set(self.directory.glob("plugins/profile/*")) - before) or [self.directory]
                steps = f"step {self.first}" if self.seen == self.first else f"steps {self.first}-{self.seen}"
                print(f"profiler: trace of {steps} written to {written[-1]} (view it with xprof "
                      f"--logdir={self.directory} --port=8791; pip install -e \".[profile]\" installs it)", flush=True)
