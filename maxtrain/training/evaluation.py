"""The eval loss: a fresh pass over each eval set, the loss averaged over its tokens; with several (eval_sources,
or each mixture source's held-out part) each has its own, and their token-weighted mean is the eval loss."""

from __future__ import annotations

import math

import jax

from maxtrain.config import load as config_lib
from maxtrain.training import step as step_lib


def _figures(loss_sum: float, tokens: float) -> dict:
    loss = loss_sum / max(tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}


def _one(c: config_lib.Config, trainer: step_lib.Trainer, params, make_batches) -> tuple[float, float]:
    """(loss sum, tokens) over (up to) eval_steps batches of a fresh pass over one eval set."""
    loss_sum, tokens, batches = 0.0, 0.0, make_batches()
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
    return loss_sum, tokens


def evaluate(c: config_lib.Config, trainer: step_lib.Trainer, params, evals: dict) -> dict:
    """{"loss", "perplexity", "tokens"} over every eval set (`evals`: name -> factory of fresh batches), and
    under "sources" each named set's own."""
    sums = {name: _one(c, trainer, params, make) for name, make in evals.items()}
    out = _figures(sum(s for s, _ in sums.values()), sum(t for _, t in sums.values()))
    named = {name: _figures(*s) for name, s in sums.items() if name}
    return {**out, "sources": named} if named else out
