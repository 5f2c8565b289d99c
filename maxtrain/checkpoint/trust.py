"""Which checkpoints hold a model that has been seen to work.

A saved state can be finite and still broken: a finite update can blow the parameters up so that every
later step is non-finite, or the loss jumps. So a checkpoint is judged by the first train step that runs
on its parameters (the step after the save, or the first step of a run that resumes from it):

- trusted: that step's loss and gradient norm were finite, and its loss was at most `loss_spike_factor`
  times the median of the recent finite losses (PaLM-style spike test; off while fewer than
  MIN_HISTORY losses are known, or with loss_spike_factor=0);
- rejected: that step was non-finite or a spike;
- pending: no step has run on it yet (a run's last save, a save just before a kill).

Verdicts and the recent losses live in `<checkpoints>/trust.json`, rewritten atomically by process 0
(every process computes the same verdicts: losses are global values). Retention never deletes the
newest trusted step; a resume skips rejected steps (moved aside as `<step>.untrusted`, never deleted).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import jax

from maxtrain.runtime import storage

FILE = "trust.json"
HISTORY = 32       # recent finite losses kept for the spike test
MIN_HISTORY = 4    # fewer than this: no spike test (the first steps of a run fall fast)


class Trust:
    def __init__(self, directory: Path, spike_factor: float):
        self.path = storage.path(directory) / FILE
        self.spike_factor = spike_factor
        self.trusted: set[int] = set()
        self.rejected: dict[int, str] = {}
        self.losses: list[float] = []
        self.awaiting: int | None = None  # the checkpoint whose first step has not been read yet
        try:
            record = json.loads(self.path.read_text())
            self.trusted = {int(s) for s in record.get("trusted", [])}
            self.rejected = {int(s): str(w) for s, w in record.get("rejected", {}).items()}
            self.losses = [float(x) for x in record.get("losses", []) if math.isfinite(float(x))][-HISTORY:]
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError) as e:
            # Unreadable verdicts: every step is pending again, so the next steps judge afresh.
            print(f"warning: {self.path} is unreadable ({type(e).__name__}); its checkpoints count as not yet "
                  "verified", flush=True)

    def verdict(self, step: int) -> str:
        if step in self.rejected:
            return "rejected"
        return "trusted" if step in self.trusted else "pending"

    def newest_trusted(self, steps) -> int | None:
        good = [s for s in steps if s in self.trusted]
        return max(good) if good else None

    def saved(self, step: int) -> None:
        """A new save of `step` (after a rollback the number can come again): its first step will judge it."""
        self.trusted.discard(step)
        self.rejected.pop(step, None)
        self.awaiting = step
        self._write()

    def resumed(self, step: int) -> None:
        self.awaiting = step if self.verdict(step) == "pending" else None

    def observe(self, step: int, loss: float, finite: bool) -> str | None:
        """Step `step` was read. If it is the first step on the awaited checkpoint's parameters, judges that
        checkpoint; returns the reason for a rejection, else None."""
        why, judged = None, False
        if self.awaiting is not None and step == self.awaiting + 1:
            checkpoint, self.awaiting, judged = step - 1, None, True
            why = self._fault(step, loss, finite)
            if why is None:
                self.trusted.add(checkpoint)
            else:
                self.rejected[checkpoint] = why
        if finite:
            self.losses = (self.losses + [loss])[-HISTORY:]
        if judged:
            self._write()
        return why

    def _fault(self, step: int, loss: float, finite: bool) -> str | None:
        if not finite:
            return f"step {step}, the first on its parameters, was not finite"
        if self.spike_factor > 0 and len(self.losses) >= MIN_HISTORY:
            reference = statistics.median(self.losses)
            if loss > self.spike_factor * reference:
                return (f"step {step}'s loss {loss:.4g} was a spike, over loss_spike_factor={self.spike_factor:g} "
                        f"x the recent median {reference:.4g}")
        return None

    def forget(self, steps) -> None:
        """Steps deleted or moved aside."""
        for s in steps:
            self.trusted.discard(s)
            self.rejected.pop(s, None)
        self._write()

    def _write(self) -> None:
        if jax.process_index() != 0:
            return
        record = {"trusted": sorted(self.trusted), "rejected": {str(s): w for s, w in sorted(self.rejected.items())},
                  "losses": self.losses}
        # A kill leaves the old verdicts or the new ones, never half a file. An OSError (a full disk) goes
        # to the checkpoint manager, which names the last good checkpoint.
        storage.write_atomic(self.path, json.dumps(record))
