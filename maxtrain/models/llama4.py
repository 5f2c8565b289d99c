"""Llama 4 (text): maxtrain's decoder with Llama 4's own attention and routing. Every Nth layer (nope_layer_interval,
4) has no RoPE, sees every key before it and scales its queries up with the position (temperature_tuning);
the others use RoPE, attend within chunks of chunk_attn_window_size positions (a query at p sees the keys from
C x floor(p / C) to p: a window whose start snaps to the chunk, see maxtrain.ops.attention.Variant) and divide
each head's q and k by their RMS, without weights (use_qk_l2_norm). Its MoE layers (every layer, as Scout, or
every Nth with dense ones between, as Maverick: interleave_moe_layer_step, maxtrain.models.stacks) score the
top-k experts by the sigmoid of their logits, unnormalised, and scale each expert's *input* by it; one shared
expert as wide as a routed one runs on every token. HF: Llama4ForCausalLM (model_type llama4_text, transformers
>= 4.51): RoPE on interleaved pairs (q/k rows permuted per head to maxtrain's halves on import), feed_forward.router,
fused experts feed_forward.experts.gate_up_proj [E, D, 2F] (gate columns first) and down_proj [E, F, D],
feed_forward.shared_expert; a dense layer's feed_forward.{gate,up,down}_proj (intermediate_size_mlp wide).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from maxtrain.models import decoder_spec, hf
from maxtrain.models.args import ModelArgs
from maxtrain.models.decoder import Decoder
from maxtrain.models.hf_layout import Tensor, same, transposed
from maxtrain.models.attention import projections
from maxtrain.models.parts import GQA, GatedMLP, MoE, moe_width
from maxtrain.models.registry import HFMapping, HFType, Keys, ModelSpec, register
from maxtrain.models.rope import rope
from maxtrain.ops.attention import Variant
from maxtrain.parallel import remat
from maxtrain.parallel.rules import constrain
from maxtrain.runtime import base_yml
from maxtrain.runtime.declaration import Key, declare
from maxtrain.runtime.errors import ConfigError, ConvertError

HEADS, KV_HEADS = ("batch", "length", "heads", "head_dim"), ("batch", "length", "kv_heads", "head_dim")


def l2_norm(x_BxLxHxK, eps: float):
    """Each head's vector divided by its RMS (Llama 4's weightless q/k norm), in float32."""
    x = x_BxLxHxK.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)).astype(x_BxLxHxK.dtype)


class Llama4SelfAttention(nn.Module):
    """GQA whose layers are of two kinds by their index: RoPE + chunks + q/k L2 norm, or NoPE + every key +
    temperature-tuned queries. Parameters as maxtrain.models.attention.Attention's (no biases, no norms)."""
    args: ModelArgs

    @nn.compact
    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, layer=None, cache=None):
        a, at = self.args, self.args.attention
        wq_DxHxK, wk_DxNxK, wv_DxNxK, wo_HxKxD = projections(self)
        q = checkpoint_name(jnp.einsum("bld,dhk->blhk", x_BxLxD, wq_DxHxK), remat.QUERY)
        k = checkpoint_name(jnp.einsum("bld,dnk->blnk", x_BxLxD, wk_DxNxK), remat.KEY)
        v = checkpoint_name(jnp.einsum("bld,dnk->blnk", x_BxLxD, wv_DxNxK), remat.VALUE)

        def attend(nope: bool, q, k, v, cache):
            if nope:  # every key before it; queries scaled up with the position (absolute, from the document's start)
                variant = Variant(scale=at.scale)
                if at.temperature_tuning:
                    scale_BxL = 1 + at.temperature_scale * jnp.log1p(jnp.floor((positions_BxL + 1) / at.floor_scale))
                    q = (q.astype(jnp.float32) * scale_BxL[:, :, None, None]).astype(q.dtype)
            else:
                variant = Variant(window=at.chunk, chunked=bool(at.chunk), scale=at.scale)
                q, k = rope(q, positions_BxL, a.rope), rope(k, positions_BxL, a.rope)
                if at.l2_norm:
                    q, k = l2_norm(q, at.eps), l2_norm(k, at.eps)
            q, k, v = constrain(q, HEADS), constrain(k, KV_HEADS), constrain(v, KV_HEADS)
            if cache is None:
                return a.plan.attend(q, k, v, segment_ids_BxL, positions_BxL, variant), None
            return cache.attend(q, k, v, segment_ids_BxL, positions_BxL, a.plan.attend, variant)

        if isinstance(layer, int):
            ctx_BxLxHxK, cache = attend(at.nope(layer), q, k, v, cache)
        else:  # a scanned stack: each layer's kind from its index, both kinds compiled
            if cache is not None:
                raise ValueError("decoding runs unrolled layers, each knowing its index")
            ctx_BxLxHxK = jax.lax.cond((layer + 1) % at.nope_interval == 0, lambda *x: attend(True, *x, None)[0],
                                       lambda *x: attend(False, *x, None)[0], q, k, v)
        ctx_BxLxHxK = checkpoint_name(ctx_BxLxHxK, remat.CONTEXT)
        return checkpoint_name(jnp.einsum("blhk,hkd->bld", ctx_BxLxHxK, wo_HxKxD), remat.OUT), cache


@dataclasses.dataclass(frozen=True)
class Llama4Attention(GQA):
    """Llama 4's attention part: GQA's parameters, and the two kinds of layer."""
    nope_interval: int = 4  # every Nth layer (the Nth, 2Nth, ...) has no RoPE and sees every key before it
    chunk: int = 0  # the RoPE layers' chunk; 0 = every key before it
    l2_norm: bool = False  # the RoPE layers' q and k divided by their RMS per head
    eps: float = 1e-5  # the L2 norm's (the model's normalization_layer_epsilon)
    temperature_tuning: bool = False  # the NoPE layers' q times 1 + scale x log1p(floor((p + 1) / floor_scale))
    temperature_scale: float = 0.1
    floor_scale: float = 8192.0
    module: ClassVar[Any] = Llama4SelfAttention
    layered: ClassVar[bool] = True

    @classmethod
    def from_config(cls, c) -> "Llama4Attention":
        return cls(**vars(GQA.from_config(c)), nope_interval=c["nope_layer_interval"],
                   chunk=c["chunk_attn_window_size"], l2_norm=c["use_qk_l2_norm"], eps=c["normalization_layer_epsilon"],
                   temperature_tuning=c["temperature_tuning"], temperature_scale=c["temperature_tuning_scale"],
                   floor_scale=c["temperature_tuning_floor_scale"])

    def nope(self, layer: int) -> bool:
        return (layer + 1) % self.nope_interval == 0


def args(c) -> ModelArgs:
    moe = MoE.from_config(c)
    return dataclasses.replace(ModelArgs.from_config(c), attention=Llama4Attention.from_config(c),
                               moe=moe and dataclasses.replace(moe, scale_input=True))


def flops_per_token(m: Keys, length: int, causal: bool = True, active: bool = True) -> float:
    """The shared count with the RoPE layers' attention over their chunks: a query sees on average half a
    chunk's keys (causal; a whole chunk otherwise) where the sequence is longer than a chunk."""
    total = decoder_spec.flops_per_token(m, length, causal, active)
    chunk, layers = m["chunk_attn_window_size"], m["base_num_decoder_layers"]
    if not chunk or length <= chunk:
        return total
    chunked = layers - layers // m["nope_layer_interval"]
    heads, hd = m["base_num_query_heads"], m["head_dim"]
    seen_all, seen_chunk = (length * 0.5, chunk * 0.5) if causal else (length, chunk)
    return total - 2 * heads * 2 * hd * chunked * (seen_all - seen_chunk)


def _nope_layers(c: Keys) -> None:
    every = c["nope_layer_interval"]
    if every > c["base_num_decoder_layers"]:
        raise ConfigError("nope_layer_interval", f"{every} exceeds base_num_decoder_layers="
                          f"{c['base_num_decoder_layers']}: no layer would be NoPE")
    if not every:
        return
    for key, plain in (("sliding_window_size", 0), ("use_qk_norm", False), ("attention_type", "gqa")):
        if c[key] != plain:
            raise ConfigError(key, f"must be {plain} with nope_layer_interval (Llama 4's layers chunk their "
                              f"attention and normalize q/k without weights: chunk_attn_window_size, use_qk_l2_norm)")
    if c["ici_pipeline_parallelism"] * c["dcn_pipeline_parallelism"] > 1:
        raise ConfigError("nope_layer_interval", "a pattern of NoPE and RoPE layers cannot be pipelined yet "
                          "(ici/dcn_pipeline_parallelism=1)")


def _own(name: str, **kw) -> Key:
    """A key only Llama 4's layers read (another family's config leaves it at base.yml's value)."""
    return Key(name, "model", family="llama4", **kw)


declare(
    _own("nope_layer_interval", at_least=0, check=_nope_layers),
    _own("chunk_attn_window_size", at_least=0),
    _own("use_qk_l2_norm"),
    _own("temperature_tuning"),
    _own("temperature_tuning_scale"),
    _own("temperature_tuning_floor_scale", above=0),
)


def _summary(c: Keys) -> str:
    layers = c["base_num_decoder_layers"]
    chunks = f" in chunks of {c['chunk_attn_window_size']}" if c["chunk_attn_window_size"] else ""
    return f"RoPE{chunks} on {layers - layers // c['nope_layer_interval']} of {layers} layers, NoPE on the rest"


# ---------------------------------------------------------------------------------------------
# HF: Llama4ForCausalLM

KIND = "llama4_text"
# Meta's interleaved RoPE pairs (2i, 2i + 1) -> maxtrain's halves (i, i + K/2): each head's q/k rows reordered
# so (even dims, odd dims); q.k is unchanged, as both move alike.


def _halves(k: int) -> np.ndarray:
    return np.concatenate([np.arange(0, k, 2), np.arange(1, k, 2)])


def _attention_tensors(m: Keys, config: dict | None) -> list[Tensor]:
    d, k = m["base_emb_dim"], m["head_dim"]
    order, back = _halves(k), np.argsort(_halves(k))
    tensors = GQA.from_config(m).hf_tensors(d)
    for i, t in enumerate(tensors):
        if t.path[-1] in ("wq", "wk"):
            count = t.hf_shape[0] // k
            tensors[i] = dataclasses.replace(
                t, to_maxtrain=lambda x, f=t.to_maxtrain: f(x)[..., order],
                to_hf=lambda w, count=count: w[..., back].reshape(d, count * k).T)
    return tensors


def _mlp_tensors(m: Keys, fused: bool) -> list[Tensor]:
    """The router, the fused experts (x @ W: no transposes) and the shared expert, under feed_forward."""
    d, e, f = m["base_emb_dim"], m["num_experts"], moe_width(m)
    return [Tensor(("mlp", "router"), "feed_forward.router.weight", (e, d), transposed, transposed),
            Tensor(("mlp", "wi_gate"), "feed_forward.experts.gate_up_proj", (e, d, 2 * f), lambda x: x[..., :f],
                   lambda gate, up: np.concatenate([gate, up], axis=-1), joins=(("mlp", "wi_up"),)),
            Tensor(("mlp", "wi_up"), "feed_forward.experts.gate_up_proj", (e, d, 2 * f), lambda x: x[..., f:], None),
            Tensor(("mlp", "wo"), "feed_forward.experts.down_proj", (e, f, d), same, same),
            *GatedMLP.from_config(m, f).hf_tensors(d, ("mlp", "shared"), "feed_forward.shared_expert")]


def _interval(no_rope: list) -> int:
    """nope_layer_interval for config.json's no_rope_layers (1 = the layer uses RoPE), or a ConvertError."""
    if not isinstance(no_rope, list) or set(no_rope) - {0, 1} or 0 not in no_rope:
        raise ConvertError(f"config.json: no_rope_layers {no_rope!r} is not supported (maxtrain's Llama 4 has "
                           f"every Nth layer without RoPE)")
    every = no_rope.index(0) + 1
    if no_rope != [int((i + 1) % every != 0) for i in range(len(no_rope))]:
        raise ConvertError(f"config.json: no_rope_layers {no_rope!r} is not supported (maxtrain's Llama 4 has "
                           f"every Nth layer without RoPE)")
    return every


def _keys(config: dict, kind: str) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    step = config.get("interleave_moe_layer_step") or 1
    moe_layers = config.get("moe_layers")
    moe_layers = list(range(step - 1, layers, step)) if moe_layers is None else moe_layers
    every = moe_layers[0] + 1 if isinstance(moe_layers, list) and moe_layers and moe_layers[0] >= 0 else 0
    if not every or layers % every or moe_layers != list(range(every - 1, layers, every)):
        raise ConvertError(f"config.json: moe_layers {moe_layers!r} is not supported (maxtrain's Llama 4 has every "
                           f"Nth layer a mixture of experts, N dividing num_hidden_layers: Scout 1, Maverick 2)")
    interval = config.get("no_rope_layer_interval") or 4
    no_rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if len(no_rope) != layers:
        raise ConvertError(f"config.json: no_rope_layers has {len(no_rope)} entries for {layers} layers")
    nope_every = _interval(no_rope)
    chunk = hf.positive_int(config, "attention_chunk_size")
    types = config.get("layer_types")
    if types is not None and types != ["chunked_attention" if r else "full_attention" for r in no_rope]:
        raise ConvertError(f"config.json: layer_types {types!r} is not supported (maxtrain's Llama 4 chunks the "
                           f"RoPE layers' attention and not the NoPE ones')")
    return hf.moe_keys(config, kind, "num_local_experts") | OWN | base_yml.defaults_of(PLAIN) | {
        "interleave_moe_layer_step": every, "base_mlp_dim": hf.positive_int(config, "intermediate_size_mlp"),
        "base_moe_mlp_dim": hf.positive_int(config, "intermediate_size"), "nope_layer_interval": nope_every,
        "chunk_attn_window_size": chunk, "use_qk_l2_norm": bool(config["use_qk_norm"]),
        "temperature_tuning": bool(config["attn_temperature_tuning"]),
        "temperature_tuning_scale": hf.number(config, "attn_scale", 0.1),
        "temperature_tuning_floor_scale": hf.number(config, "floor_scale", 8192.0)}


# What Llama 4's MoE layers are, and keys it has only at base.yml's values (export refuses any other).
OWN = {"shared_experts": 1, "routed_score_func": "sigmoid"}
PLAIN = ("norm_topk_prob", "first_num_dense_layers", "routed_bias", "routed_scaling_factor", "n_routing_groups",
         "topk_routing_group", "use_qk_norm")


def _hf_kind(m: Keys) -> str:
    if m["num_experts"] == 1:
        raise ConvertError("num_experts=1: maxtrain's HF Llama 4 has mixtures of experts (every layer, as Scout, or "
                           "every Nth: interleave_moe_layer_step)")
    for key, value in {**OWN, **base_yml.defaults_of(PLAIN)}.items():
        if m[key] != value:
            raise ConvertError(f"{key}={m[key]!r}: Llama 4 has {value!r} (HF export needs it)")
    if not m["chunk_attn_window_size"]:
        raise ConvertError("chunk_attn_window_size=0: HF's Llama 4 chunks its RoPE layers' attention (export needs "
                           "a chunk)")
    return KIND


def _config(m: Keys, kind: str, config: dict) -> dict[str, Any]:
    layers, every, step = m["base_num_decoder_layers"], m["nope_layer_interval"], m["interleave_moe_layer_step"]
    no_rope = [int((i + 1) % every != 0) for i in range(layers)]
    return {"intermediate_size": moe_width(m), "intermediate_size_mlp": m["base_mlp_dim"],
            "num_local_experts": m["num_experts"], "num_experts_per_tok": m["num_experts_per_tok"],
            "router_aux_loss_coef": m["load_balance_loss_weight"], "interleave_moe_layer_step": step,
            "moe_layers": list(range(step - 1, layers, step)), "no_rope_layer_interval": every,
            "no_rope_layers": no_rope,
            "layer_types": ["chunked_attention" if r else "full_attention" for r in no_rope],
            "attention_chunk_size": m["chunk_attn_window_size"], "use_qk_norm": m["use_qk_l2_norm"],
            "attn_temperature_tuning": m["temperature_tuning"], "attn_scale": m["temperature_tuning_scale"],
            "floor_scale": hf.whole(m["temperature_tuning_floor_scale"]), "attention_bias": False}


HF = HFMapping(
    types={KIND: HFType("Llama4ForCausalLM", "Llama4TextConfig", {"max_position_embeddings": 131072} | dict(zip(
        hf.SHAPE, (202048, 5120, 8192, 48, 40, 8))) | {
        "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "head_dim": 128, "intermediate_size_mlp": 16384, "attention_bias": False, "attention_chunk_size": 8192,
        "attn_scale": 0.1, "attn_temperature_tuning": True, "floor_scale": 8192, "interleave_moe_layer_step": 1,
        "moe_layers": None, "no_rope_layer_interval": 4, "no_rope_layers": None, "layer_types": None,
        "num_experts_per_tok": 1, "num_local_experts": 16, "router_aux_loss_coef": 0.001, "use_qk_norm": True,
        "bos_token_id": 1, "eos_token_id": 2})},
    keys=_keys,
    config=_config,
    mlp_tensors=_mlp_tensors,
    attention_tensors=_attention_tensors,
    sliding_window=lambda config: None,  # its chunks are read with the layer kinds (_keys)
    dense_mlp_name="feed_forward",
    expresses=("interleave_moe_layer_step", "nope_layer_interval", "chunk_attn_window_size", "use_qk_l2_norm",
               "temperature_tuning"),
)

SPEC = register(ModelSpec(name="llama4", matches=lambda m: m["nope_layer_interval"] != 0, hf_kind=_hf_kind, hf=HF,
                          priority=3, matches_hint="nope_layer_interval > 0",
                          summary=_summary, **decoder_spec.spec_parts(args=args, build=lambda c: Decoder(args(c)),
                                                                      flops_per_token=flops_per_token)))
