"""Multi-token prediction (DeepSeek-V3, MaxText's mtp_num_layers): depth k of the model's mtp_layers
predicts, at each position i, the token k + 1 ahead (target i + k): from depth k - 1's hidden state at i
(the main stack's, before the final norm, for depth 1) and the embedding of the token k ahead (input
i + k), each RMS-normalized, joined and projected back to the model's width, through one more decoder
layer (a mixture of experts where the model's last layers are). The depths share the model's embedding
and output layer; each has its own final norm. Their mean cross-entropy, times mtp_loss_scaling_factor,
joins the loss. Training only: decoding and HF export leave the depths out.

Shape suffixes as in maxtrain.models.decoder, and M depths.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from maxtrain.models.args import ModelArgs
from maxtrain.models.layers import RMSNorm, dense_weight


class MTPDepth(nn.Module):
    """One depth: (its hidden state [B,L,D] before the norm, for the next depth; normalized, for the logits)."""
    args: ModelArgs
    layer: type[nn.Module]  # the decoder layer class, rematerialized as the plan says
    moe: bool
    index: int  # the layer's index counted past the main stack's (a patterned model's global or sliding kind)

    @nn.compact
    def __call__(self, previous_BxLxD, embedded_BxLxD, positions_BxL, segment_ids_BxL):
        a = self.args
        joined_BxLx2D = jnp.concatenate([RMSNorm(a, name="embedding_norm")(embedded_BxLxD),
                                         RMSNorm(a, name="hidden_norm")(previous_BxLxD)], axis=-1)
        # [2D, D]: "mlp" on the joined width, so no two dimensions share a logical name
        projection_2DxD = dense_weight(self, "projection", (2 * a.embed, a.embed), ("mlp", "embed"))
        x_BxLxD = jnp.einsum("blj,jd->bld", joined_BxLx2D, projection_2DxD)
        x_BxLxD, _ = self.layer(a, self.moe, name="layer")(x_BxLxD, positions_BxL, segment_ids_BxL, self.index)
        return x_BxLxD, RMSNorm(a, name="output_norm")(x_BxLxD)


def shifted(batch: dict, depths: int) -> dict:
    """The batch with each depth k's arrays beside its own: mtp_inputs_k (the tokens k ahead), mtp_targets_k
    (the targets k ahead) and mtp_weights_k (the targets' weights where position i + k is in position i's
    document, else 0), all [B, L] in sequence order (before any reordering of positions)."""
    out = dict(batch)
    length = batch["inputs"].shape[1]
    for k in range(1, depths + 1):
        ahead = lambda x, k=k: jnp.pad(x[:, k:], [(0, 0), (0, k)])  # noqa: E731  x[:, i + k], 0 past the end
        same = (ahead(batch["segment_ids"]) == batch["segment_ids"]) & (jnp.arange(length) < length - k)
        out[f"mtp_inputs_{k}"] = ahead(batch["inputs"])
        out[f"mtp_targets_{k}"] = ahead(batch["targets"])
        out[f"mtp_weights_{k}"] = jnp.where(same, ahead(batch["weights"]), 0).astype(batch["weights"].dtype)
    return out


def depth_tokens(batch: dict, depths: int):
    """[M, B, L]: each depth's input tokens (shifted's mtp_inputs_k), or None without depths."""
    return jnp.stack([batch[f"mtp_inputs_{k}"] for k in range(1, depths + 1)]) if depths else None
