"""Llama-family decoder in Flax linen: RMSNorm, RoPE, GQA attention, SwiGLU or a mixture of experts,
scanned layers.

The model says nothing about devices: parameters and activations carry logical axis names
(batch, length, embed, heads, kv_heads, head_dim, mlp, vocab, layers, norm) and the mesh rules in the
config decide where each lives; how a layer runs (kernels, chunks, remat, the scan's unroll) is the
execution plan's (maxtrain.parallel.plan). Shape suffixes: B batch, L length, D embed, H query heads,
N kv heads, G query heads per kv head, K head dim, F mlp, V vocab.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxtrain.models import moe, stacks as stacks_lib
from maxtrain.models.args import ModelArgs
from maxtrain.models.attention import Attention
from maxtrain.models.layers import MLP, RMSNorm, dense_weight
from maxtrain.models.mla import MLAttention
from maxtrain.models.mtp import MTPDepth
from maxtrain.parallel.rules import constrain


class DecoderLayer(nn.Module):
    args: ModelArgs
    moe: bool = False  # the MLP is a mixture of experts

    @nn.compact
    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, layer=None, cache=None):
        """`layer`: the index of this layer in the model, where some layers slide and some do not."""
        a, axes = self.args, ("batch", "length", "embed")
        x_BxLxD = constrain(x_BxLxD, axes)
        # DeepSeek's latent attention, or GQA; a family's own module where its part names one
        attention = a.attention.module or (MLAttention if a.mla else Attention)
        h, cache = attention(a, name="attention")(RMSNorm(a, name="attention_norm")(x_BxLxD),
                                                  positions_BxL, segment_ids_BxL, layer, cache)
        if a.norm.after_attention:  # sandwich norms (Gemma): the block's output normalized before the residual
            h = RMSNorm(a, name="post_attention_norm")(h)
        x_BxLxD = constrain(x_BxLxD + h, axes)
        mlp = moe.MoEBlock(a, name="mlp") if self.moe else MLP(a, name="mlp")
        h = mlp(RMSNorm(a, name="mlp_norm")(x_BxLxD))
        if a.norm.after_mlp:
            h = RMSNorm(a, name="post_mlp_norm")(h)
        return constrain(x_BxLxD + h, axes), cache  # (carry, per-layer output) for nn.scan; cache: decoding


class Period(nn.Module):
    """`period` consecutive layers as one step of a scanned stack (maxtrain.models.stacks: MoE layers
    interleaved with dense ones); the last of them MoE. `layer`: the first one's index, where needed."""
    args: ModelArgs
    layer_type: Any
    period: int

    @nn.compact
    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, layer=None):
        for j in range(self.period):
            x_BxLxD, _ = self.layer_type(self.args, j == self.period - 1, name=stacks_lib.period_position(j))(
                x_BxLxD, positions_BxL, segment_ids_BxL, None if layer is None else layer + j)
        return x_BxLxD, None


class Decoder(nn.Module):
    args: ModelArgs

    @nn.compact
    def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None, return_hidden=False, cache=None,
                 mtp_tokens_MxBxL=None):
        """Logits [B,L,V] in float32; with return_hidden, (final hidden [B,L,D], output matrix [D,V] in
        its stored dtype) so the loss can form the logits chunk by chunk, and with each multi-token
        prediction depth's input tokens (maxtrain.models.mtp) a third, each depth's final hidden [M,B,L,D].
        With a KV cache (maxtrain.infer.kv_cache; unrolled layers only), (that, the cache with these
        tokens written)."""
        a = self.args
        if cache is not None and a.scan_layers:
            raise ValueError("decoding with a KV cache runs unrolled layers: maxtrain.infer unstacks them")
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
        if segment_ids_BxL is None:
            segment_ids_BxL = jnp.ones_like(tokens_BxL)

        embed_init = nn.with_logical_partitioning(nn.initializers.normal(a.embed ** -0.5), ("vocab", "embed"))
        embedding_VxD = self.param("embedding", embed_init, (a.vocab.padded, a.embed), a.weight_dtype)

        def embed(tokens_BxL):
            x_BxLxD = a.plan.embed(embedding_VxD, tokens_BxL, a.dtype)
            return x_BxLxD * jnp.asarray(a.embed ** 0.5, a.dtype) if a.vocab.scale_input else x_BxLxD
        x_BxLxD = embed(tokens_BxL)

        layer = a.plan.remat(DecoderLayer, a.scan_layers)
        first, stacks, layer_caches = 0, a.stacks(), []
        for index, s in enumerate(stacks):
            name, count, is_moe, steps = s.name, s.count, s.moe, s.count // s.period
            pipelined = a.plan.pipelines(index, len(stacks))
            if a.scan_layers:  # intermediates: MoE layers record their load and auxiliary losses
                # a patterned model's layers each get their index, scanned (attention picks its kind by it)
                indices = (jnp.arange(first, first + count, s.period),) if a.attention.layered else ()
                step = layer if s.period == 1 else functools.partial(Period, layer_type=layer, period=s.period)
                stack = nn.scan(step, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                                in_axes=(nn.broadcast, nn.broadcast, *(0,) * len(indices)), length=steps,
                                unroll=a.plan.unroll(steps),
                                metadata_params={nn.PARTITION_NAME: a.plan.layers_axis(pipelined)})
                if pipelined and not self.is_initializing():  # the same parameters, run stage by stage
                    x_BxLxD, records = a.plan.pipeline(functools.partial(apply_layer, a, is_moe),
                                                       self.variables["params"][name], x_BxLxD, positions_BxL,
                                                       segment_ids_BxL)
                    if records and self.is_mutable_collection("intermediates"):
                        self.put_variable("intermediates", name, records)
                elif s.period == 1:
                    x_BxLxD, _ = stack(a, is_moe, name=name)(x_BxLxD, positions_BxL, segment_ids_BxL, *indices)
                else:
                    x_BxLxD, _ = stack(a, name=name)(x_BxLxD, positions_BxL, segment_ids_BxL, *indices)
            else:
                for i in range(first, first + count):
                    x_BxLxD, written = layer(a, s.is_moe(i), name=stacks_lib.unrolled(i))(
                        x_BxLxD, positions_BxL, segment_ids_BxL, i, None if cache is None else cache.layer(i))
                    layer_caches.append(written)
            first += count

        depths_MxBxLxD = None
        if a.mtp_layers and cache is None and (mtp_tokens_MxBxL is not None or self.is_initializing()):
            if mtp_tokens_MxBxL is None:  # init: any tokens make the depths' parameters
                mtp_tokens_MxBxL = jnp.broadcast_to(tokens_BxL, (a.mtp_layers, *tokens_BxL.shape))
            hidden_BxLxD, normed = x_BxLxD, []
            for k in range(1, a.mtp_layers + 1):
                depth = MTPDepth(a, a.plan.remat(DecoderLayer, False), stacks[-1].moe, a.layers + k - 1,
                                 name=stacks_lib.mtp(k))
                hidden_BxLxD, out_BxLxD = depth(hidden_BxLxD, embed(mtp_tokens_MxBxL[k - 1]), positions_BxL,
                                                segment_ids_BxL)
                normed.append(out_BxLxD)
            depths_MxBxLxD = jnp.stack(normed)

        x_BxLxD = RMSNorm(a, name="final_norm")(x_BxLxD)
        if a.vocab.tied:
            out_DxV = embedding_VxD.T
        else:
            out_DxV = dense_weight(self, "output", (a.embed, a.vocab.padded), ("embed", "vocab"), stored_dtype=True)
        if return_hidden:  # the output matrix padded: see mask_padding
            result = (x_BxLxD, out_DxV) + (() if mtp_tokens_MxBxL is None or depths_MxBxLxD is None
                                           else (depths_MxBxLxD,))
        else:
            logits_BxLxV = output_logits(x_BxLxD, out_DxV, a.logits_dot_in_fp32, a.vocab.logit_softcap)[..., :a.vocab.size]
            result = constrain(logits_BxLxV, ("batch", "length", "vocab"))
        return result if cache is None else (result, cache.written(layer_caches, tokens_BxL.shape[1]))


def apply_layer(args: ModelArgs, is_moe: bool, params, x_BxLxD, positions_BxL, segment_ids_BxL):
    """One layer as a function of its parameters: (output, what it records), for the pipeline."""
    (x_BxLxD, _), recorded = DecoderLayer(args, is_moe).apply({"params": params}, x_BxLxD, positions_BxL,
                                                              segment_ids_BxL, mutable=["intermediates"])
    return x_BxLxD, recorded.get("intermediates", {})


def output_logits(x_BxLxD, out_DxV, dot_in_fp32: bool, softcap: float = 0.0):
    """float32 logits from a matmul in x's (the compute) dtype: its output in float32, or rounded to
    the compute dtype and then cast (half the memory traffic; faster where float32 output is costly).
    With `softcap`, softcap x tanh(logits / softcap) (Gemma 2)."""
    out_DxV = out_DxV.astype(x_BxLxD.dtype)
    if dot_in_fp32:
        logits = jnp.einsum("bld,dv->blv", x_BxLxD, out_DxV, preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("bld,dv->blv", x_BxLxD, out_DxV).astype(jnp.float32)
    return softcap * jnp.tanh(logits / softcap) if softcap else logits


def mask_padding(logits_BxLxV, vocab: int):
    """Logits over the padded vocabulary with the padding's at -inf: out of log Z, probability 0, gradient 0."""
    if logits_BxLxV.shape[-1] == vocab:
        return logits_BxLxV
    return jnp.where(jnp.arange(logits_BxLxV.shape[-1]) < vocab, logits_BxLxV, -jnp.inf)


def unstack_layers(params: dict, args: ModelArgs) -> dict:
    """Scanned params ({'layers': stacked}, or an MoE model's stacks) -> unrolled ({'layers_0': ...})."""
    params = dict(params)
    for s in args.stacks():
        stacked = params.pop(s.name)
        for sub, _, layers in s.positions():
            for t, i in enumerate(layers):
                params[stacks_lib.unrolled(i)] = jax.tree.map(lambda x, t=t: x[t], stacked[sub] if sub else stacked)
    return params


def stack_layers(params: dict, args: ModelArgs) -> dict:
    """Unrolled layout -> scanned layout: each stack (each position of its period) with a leading `layers` axis."""
    params = dict(params)
    for s in args.stacks():
        subtrees = {sub: jax.tree.map(lambda *xs: jnp.stack(xs), *[params.pop(stacks_lib.unrolled(i)) for i in layers])
                    for sub, _, layers in s.positions()}
        params[s.name] = subtrees[""] if "" in subtrees else subtrees
    return params
