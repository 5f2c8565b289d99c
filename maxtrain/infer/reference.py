"""Decoding without a cache, the tests' and benchmarks/decode.py's reference: each new token reruns the
whole model over one fixed buffer (prompt + max_new_tokens), so one compiled program serves every
position and causal attention makes the unwritten tail irrelevant. Quadratic in the output length."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from maxtrain.infer.sampling import Sampling
from maxtrain.models.decoder import output_logits
from maxtrain.ops.attention import SPLASH
from maxtrain.parallel import pipeline, rules as rules_lib


def rerun_step(c, trainer, sampling: Sampling = Sampling(), start: int = 0):
    """The jitted step: (params, buffer [R,T], position) -> (the buffer with the next token written at
    `position`, that token), sampling's draw numbered position - start (start: the prompt's length)."""
    args = trainer.model.args
    model = trainer.model.clone(args=dataclasses.replace(args, plan=dataclasses.replace(
        args.plan, context_load_balance=False, schedule=pipeline.Schedule())))
    rows = rules_lib.shards(c.logical_axis_rules, "batch", c.mesh_shape)  # every batch shard a copy
    keys_R = sampling.row_keys(np.zeros(rows, np.int32))  # prompt number 0, as the first of a batch

    def step(params, buffer_RxT, position):
        hidden_RxTxD, out_DxV = model.apply({"params": params}, buffer_RxT, return_hidden=True)
        hidden_Rx1xD = jax.lax.dynamic_slice_in_dim(hidden_RxTxD, position - 1, 1, axis=1)
        logits_RxV = output_logits(hidden_Rx1xD, out_DxV, c.logits_dot_in_fp32, c.final_logit_softcapping)[:, 0, :c.vocab_size]
        token_R = sampling.choose(logits_RxV, keys_R, position - start)
        return buffer_RxT.at[:, position].set(token_R), token_R[0]

    return jax.jit(step, out_shardings=(trainer.batch_sharding, rules_lib.replicated(trainer.mesh)), donate_argnums=1)


def full_rerun(c, trainer, params, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
               eos_id: int | None = None) -> list[int]:
    """New ids after one prompt (greedy unless `sampling` says otherwise). Call under the trainer's mesh."""
    start, total = len(prompt_ids), len(prompt_ids) + max_new_tokens
    seq_shards = rules_lib.sequence_shards(c.logical_axis_rules, c.mesh_shape)
    multiple = seq_shards * (128 if c.attention in SPLASH else 1)  # each device's share whole
    total = -(-total // multiple) * multiple
    rows = rules_lib.shards(c.logical_axis_rules, "batch", c.mesh_shape)
    buffer_RxT = np.zeros((rows, total), np.int32)
    buffer_RxT[:, :start] = prompt_ids
    buffer_RxT = jax.device_put(buffer_RxT, trainer.batch_sharding)
    step, new = rerun_step(c, trainer, sampling, start), []
    for position in range(start, start + max_new_tokens):
        buffer_RxT, token = step(params, buffer_RxT, position)
        new.append(int(token))
        if new[-1] == eos_id:
            break
    return new
