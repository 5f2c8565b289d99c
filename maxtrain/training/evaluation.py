"""The eval loss: a fresh pass over the eval documents, the loss averaged over their tokens."""

from __future__ import annotations

import math

import jax

from maxtrain.config import load as config_lib
from maxtrain.training import step as step_lib


def evaluate(c: config_lib.Config, trainer: step_lib.Trainer, params, make_eval_iterator) -> dict:
    """Loss over (up to) eval_steps batches of a fresh pass over the eval documents."""
    loss_sum, tokens, batches = 0.0, 0.0, make_eval_iterator()
    try:
        for _ in range(c.eval_steps):
            try:
                batch = next(batches)
            except StopIteration:
                break
            out = jax.device_get(trainer.eval_step(params, batch))
            if out["tokens"] == 0:  # every process's rows are used up (several processes pad: data/pipeline.py)
                break
            loss_sum, tokens = loss_sum + float(out["loss_sum"]), tokens + float(out["tokens"])
    finally:
        batches.close()  # its reading thread
    loss = loss_sum / max(tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}
