"""The embedding lookup under a mesh that splits the table's columns."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maxtrain.parallel.rules import active_axes, active_spec, constrain, splits_evenly


def lookup(embedding_VxD, tokens_BxL, dtype):
    """The table's rows for the tokens, in `dtype`. Under a mesh that splits the table's columns
    (fsdp), each device looks up the tokens of all the devices sharing the table in the columns it
    holds, then takes back its own tokens' whole rows (an all-to-all the size of the result): the
    table never moves, and its gradient is a float32 scatter-add into each device's own columns. Left
    to GSPMD, XLA added into a whole [V, D] float32 table."""
    take = lambda table_VxE, tokens: jnp.take(table_VxE, tokens, axis=0).astype(dtype)  # noqa: E731
    column_axes = active_axes(("vocab", "embed"), embedding_VxD.shape)[1]  # as the table is split
    if not column_axes or not splits_evenly(("batch", "length"), tokens_BxL.shape):
        return constrain(take(embedding_VxD, tokens_BxL), ("batch", "length", "embed"))
    token_spec = active_spec(("batch", "length"))

    def local(table_VxE, tokens_BxL):
        all_tokens_T = jax.lax.all_gather(tokens_BxL.reshape(-1), column_axes, tiled=True)
        rows_TxE = take(table_VxE, all_tokens_T)
        rows_BLxD = jax.lax.all_to_all(rows_TxE, column_axes, 0, 1, tiled=True)
        return rows_BLxD.reshape(*tokens_BxL.shape, -1)
    # the table's rows whole on entry (a vocab split, by tensor, is gathered: a slice of columns is small)
    return jax.shard_map(local, in_specs=(PartitionSpec(None, column_axes), token_spec),
                         out_specs=PartitionSpec(*token_spec, None), check_vma=False)(embedding_VxD, tokens_BxL)
