"""What a non-finite step leads to. (A SIGTERM or Ctrl-C as a step to stop at: interrupts.Preemption.)"""

from __future__ import annotations

from maxtrain.config import load as config_lib
from maxtrain.runtime import errors


class NonFiniteGuard:
    """What follows a step whose loss, gradient norm or new parameters were not finite. The step itself
    already dropped the update (step.py); this decides, one step late, between going on (skip), restoring
    the newest checkpoint (rollback) and stopping, and stops any policy after max_nonfinite_steps."""

    def __init__(self, c: config_lib.Config):
        self.policy, self.limit, self.count = c.nan_policy, c.max_nonfinite_steps, 0

    def on_bad_step(self, step: int, last_trusted: str) -> str:
        self.count += 1
        if self.policy == "stop":
            raise errors.RunError(f"step {step}: the loss or gradients are not finite (nan_policy=stop); the "
                                  f"update was not applied and nothing more is saved; {last_trusted}")
        if self.count > self.limit:
            raise errors.RunError(f"step {step}: {self.count} non-finite steps, more than max_nonfinite_steps="
                                  f"{self.limit} (nan_policy={self.policy}); the run diverges: lower the "
                                  f"learning_rate or set gradient_clipping_threshold; {last_trusted}")
        return self.policy
