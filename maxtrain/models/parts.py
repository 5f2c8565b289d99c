"""The parts a decoder layer is made of, each as a spec: what a family chose for it (read from the model keys
alone, so a checkpoint's description builds it), the parameters and matmul FLOPs it counts, and the HF
tensors it names. The module that runs each is beside its kind: RMSNorm and MLP (maxtrain.models.layers),
Attention (attention.py), MLAttention (mla.py), MoEBlock (moe.py); maxtrain.models.args.ModelArgs gathers
a model's parts, and maxtrain.models.decoder_spec sums their counts over the layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from maxtrain.models.hf_layout import Tensor, same, transposed
from maxtrain.models.rope import Rope

# The embedding and output matrices hold the vocabulary padded to a multiple of this (Megatron's default
# make_vocab_size_divisible_by), so a tensor axis of up to 128 splits them evenly whatever the true size
# (32001, 50257). A multiple that does not depend on the mesh keeps the checkpoint's shapes the same on
# every mesh: a run resumes on another. The padded entries' logits are masked (loss) or cut (logits).
VOCAB_MULTIPLE = 128


def padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The model's two ends: the token embedding [padded V, D] and the output projection [D, padded V] (the
    embedding's transpose where tied), and what a family does at each."""
    size: int  # the true vocabulary; the matrices hold padded_vocab(size) entries
    tied: bool = False
    scale_input: bool = False  # embeddings x sqrt(embed) (Gemma)
    logit_softcap: float = 0.0  # logits -> cap x tanh(logits / cap) (Gemma 2); 0 = none

    @classmethod
    def from_config(cls, c) -> "Vocabulary":
        return cls(c["vocab_size"], c["logits_via_embedding"], c["scale_embedding"], c["final_logit_softcapping"])

    @property
    def padded(self) -> int:
        return padded_vocab(self.size)

    def params(self, embed: int) -> int:
        """The padding left out: storage, not parameters."""
        return self.size * embed * (1 if self.tied else 2)

    def hf_tensors(self, embed: int) -> list[Tensor]:
        """model.embed_tokens and (untied) lm_head: HF's true vocabulary, maxtrain's padded with zero rows."""
        v, d, pad = self.size, embed, self.padded - self.size
        rows = (lambda x: np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])) if pad else same
        cut = (lambda w: w[:v]) if pad else same
        tensors = [Tensor(("embedding",), "model.embed_tokens.weight", (v, d), rows, cut)]
        if not self.tied:
            tensors.append(Tensor(("output",), "lm_head.weight", (v, d), lambda x: rows(x).T, lambda w: cut(w.T)))
        return tensors


@dataclasses.dataclass(frozen=True)
class Norm:
    """RMSNorm: x / rms(x) times a learned scale, or times (1 + scale) (Gemma). Each layer normalizes the
    attention's and the MLP's inputs; sandwich norms (Gemma) also normalize each block's output before the
    residual adds it."""
    eps: float
    plus_one: bool = False
    after_attention: bool = False
    after_mlp: bool = False

    @classmethod
    def from_config(cls, c) -> "Norm":
        return cls(c["normalization_layer_epsilon"], c["rms_norm_plus_one"], c["use_post_attn_norm"],
                   c["use_post_ffw_norm"])

    def params(self, embed: int) -> int:
        """A layer's norms."""
        return embed * (2 + self.after_attention + self.after_mlp)


@dataclasses.dataclass(frozen=True)
class GatedMLP:
    """down(act(gate(x)) * up(x)) of width `width`: SwiGLU (silu), GeGLU (gelu_tanh) or gpt-oss's
    clamped SwiGLU (clamped_swiglu, clamped at `limit`); with `bias`, each projection's bias."""
    width: int
    activation: str = "silu"
    limit: float = 0.0
    bias: bool = False

    @classmethod
    def from_config(cls, c, width: int | None = None) -> "GatedMLP":
        return cls(c["base_mlp_dim"] if width is None else width, c["mlp_activation"], c["mlp_activation_limit"],
                   c["mlp_bias"])

    def params(self, embed: int) -> int:
        return 3 * embed * self.width + (2 * self.width + embed if self.bias else 0)

    def flops(self, embed: int) -> float:
        """Matmul FLOPs per token."""
        return 2 * 3 * embed * self.width

    def hf_tensors(self, embed: int, path: tuple[str, ...] = ("mlp",), name: str = "mlp") -> list[Tensor]:
        """HF's <name>.gate_proj, up_proj, down_proj, for the parameters under `path`."""
        d, f, T = embed, self.width, transposed
        return [Tensor((*path, "wi_gate"), f"{name}.gate_proj.weight", (f, d), T, T),
                Tensor((*path, "wi_up"), f"{name}.up_proj.weight", (f, d), T, T),
                Tensor((*path, "wo"), f"{name}.down_proj.weight", (d, f), T, T)]


@dataclasses.dataclass(frozen=True)
class Window:
    """Sliding-window attention: a sliding layer's query sees the keys at distance < size. With
    global_interval N every Nth layer attends over the whole context (Gemma 2 and gpt-oss: 2, Gemma 3: 6);
    0: every layer slides. The sliding layers use their own RoPE (Gemma 3's local_rope_theta), or the model's."""
    size: int
    global_interval: int
    rope: Rope

    @classmethod
    def from_config(cls, c) -> "Window | None":
        """None where no layer slides (sliding_window_size 0)."""
        if not c["sliding_window_size"]:
            return None
        local = None if c["local_rope_theta"] == -1 else c["local_rope_theta"]
        return cls(c["sliding_window_size"], c["global_layer_interval"], Rope.from_config(c, local))

    @property
    def every_layer(self) -> bool:
        """Every layer slides (no global ones)."""
        return self.global_interval == 0

    def slides(self, layer: int) -> bool:
        """Whether layer `layer` (counted over the whole model) attends within the window."""
        return self.every_layer or (layer + 1) % self.global_interval != 0


@dataclasses.dataclass(frozen=True)
class GQA:
    """Grouped-query attention: `heads` query heads sharing `kv_heads` key/value heads of `head_dim`."""
    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # the scores' scale: (query_pre_attn_scalar, or head_dim) ** -0.5
    qkv_bias: bool = False  # Qwen2, gpt-oss
    out_bias: bool = False  # gpt-oss
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sinks: bool = False  # a learned logit per head in the softmax's denominator (gpt-oss)
    softcap: float = 0.0  # scores -> cap x tanh(scores / cap) (Gemma 2); 0 = none
    window: Window | None = None  # sliding-window attention on some or all layers
    module: ClassVar[Any] = None  # a family's own attention module for it (llama4.py); None: models.attention's

    @classmethod
    def from_config(cls, c) -> "GQA":
        return cls(c["base_num_query_heads"], c["base_num_kv_heads"], c["head_dim"],
                   (c["query_pre_attn_scalar"] or c["head_dim"]) ** -0.5, c["qkv_bias"], c["attention_out_bias"],
                   c["use_qk_norm"], c["attention_sinks"], c["attn_logit_softcapping"], Window.from_config(c))

    @property
    def layered(self) -> bool:
        """Its layers differ by their index (some slide, some do not): a scanned stack passes each its own."""
        return self.window is not None and not self.window.every_layer

    @property
    def qk_head_dim(self) -> int:
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.head_dim

    def params(self, embed: int) -> int:
        h, n, k = self.heads, self.kv_heads, self.head_dim
        return (embed * k * (2 * h + 2 * n) + (k * (h + 2 * n) if self.qkv_bias else 0) + (2 * k if self.qk_norm else 0)
                + (h if self.sinks else 0) + (embed if self.out_bias else 0))

    def projection_flops(self, embed: int) -> float:
        """Matmul FLOPs per token of the q/k/v and output projections."""
        return 2 * embed * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def cache_layout(self) -> tuple[int, int, int]:
        """A decoding cache's (rows per sequence, key width, value width): the kv heads."""
        return self.kv_heads, self.head_dim, self.head_dim

    def hf_tensors(self, embed: int) -> list[Tensor]:
        """HF's self_attn projections, and its q/k norms, biases and sinks where the model has them."""
        d, h, n, k = embed, self.heads, self.kv_heads, self.head_dim

        def heads_out(count):  # [count*K, D] <-> [D, count, K]
            return (lambda x: x.T.reshape(d, count, k)), (lambda w: w.reshape(d, count * k).T)

        def bias(count):  # [count*K] <-> [count, K]
            return (lambda x: x.reshape(count, k)), (lambda w: w.reshape(count * k))

        tensors = [
            Tensor(("attention", "wq"), "self_attn.q_proj.weight", (h * k, d), *heads_out(h)),
            Tensor(("attention", "wk"), "self_attn.k_proj.weight", (n * k, d), *heads_out(n)),
            Tensor(("attention", "wv"), "self_attn.v_proj.weight", (n * k, d), *heads_out(n)),
            Tensor(("attention", "wo"), "self_attn.o_proj.weight", (d, h * k),
                   lambda x: x.T.reshape(h, k, d), lambda w: w.reshape(h * k, d).T),
        ]
        if self.qk_norm:
            tensors += [Tensor(("attention", "q_norm", "scale"), "self_attn.q_norm.weight", (k,), same, same),
                        Tensor(("attention", "k_norm", "scale"), "self_attn.k_norm.weight", (k,), same, same)]
        if self.qkv_bias:
            tensors += [Tensor(("attention", "bq"), "self_attn.q_proj.bias", (h * k,), *bias(h)),
                        Tensor(("attention", "bk"), "self_attn.k_proj.bias", (n * k,), *bias(n)),
                        Tensor(("attention", "bv"), "self_attn.v_proj.bias", (n * k,), *bias(n))]
        if self.out_bias:
            tensors.append(Tensor(("attention", "bo"), "self_attn.o_proj.bias", (d,), same, same))
        if self.sinks:
            tensors.append(Tensor(("attention", "sinks"), "self_attn.sinks", (h,), same, same))
        return tensors


@dataclasses.dataclass(frozen=True)
class MLA:
    heads: int
    q_lora_rank: int  # 0 = a full query projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float  # the scores' scale
    module: ClassVar[Any] = None  # (as GQA's) None: models.mla's
    layered: ClassVar[bool] = False
    window: ClassVar[None] = None  # no layer slides (validate refuses a window with MLA)

    @classmethod
    def from_config(cls, c) -> "MLA":
        """The scale: (query_pre_attn_scalar, or the q/k head width) ** -0.5; under yarn with HF's
        mscale_all_dim, times m(mscale_all_dim) ** 2, as DeepSeek's attention."""
        scale = (c["query_pre_attn_scalar"] or c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) ** -0.5
        if c["rope_yarn_mscale_all_dim"]:
            scale *= Rope.from_config(c).yarn_scale(c["rope_yarn_mscale_all_dim"]) ** 2
        return cls(c["base_num_query_heads"], c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"],
                   c["qk_rope_head_dim"], c["v_head_dim"], scale)

    @property
    def qk_head_dim(self) -> int:
        """A head's query and key width: the part without RoPE and the part with it."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, embed: int) -> int:
        d, h, q, c, r = embed, self.heads, self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim
        queries = d * q + q + q * h * self.qk_head_dim if q else d * h * self.qk_head_dim
        return queries + d * (c + r) + c + c * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * d

    def projection_flops(self, embed: int) -> float:
        return 2 * (self.params(embed) - self.q_lora_rank - self.kv_lora_rank)  # the latent norms do no matmul

    def cache_layout(self) -> tuple[int, int, int]:
        """A decoding cache's (rows per sequence, key width, value width): the rotary key and the latent."""
        return 1, self.qk_rope_head_dim, self.kv_lora_rank


def moe_width(m) -> int:
    """Each expert's MLP width: base_moe_mlp_dim, where -1 means base_mlp_dim."""
    return m["base_mlp_dim"] if m["base_moe_mlp_dim"] == -1 else m["base_moe_mlp_dim"]


@dataclasses.dataclass(frozen=True)
class MoE:
    num_experts: int
    experts_per_token: int
    expert: GatedMLP  # each routed expert; the shared experts are one such MLP of their joint width
    shared_experts: int = 0  # always-on experts (DeepSeek, Qwen2-MoE)
    first_dense_layers: int = 0  # the model's leading layers with a dense MLP instead
    score_func: str = "softmax"  # softmax | sigmoid
    norm_topk_prob: bool = False  # the top-k weights renormalised to sum to 1
    routed_bias: bool = False  # DeepSeek-V3's balancing bias: not trained, moved by the train step
    scaling_factor: float = 1.0  # the routed experts' weights times this
    logit_bias: bool = False  # gpt-oss: a trained bias on the router's logits
    groups: int = 0  # group-limited routing: the experts' groups, and how many a token picks from; 0 = none
    top_groups: int = 0
    scale_input: bool = False  # the routing weights scale each expert's input, not its output (Llama 4's family)
    interleave: int = 1  # every Nth layer an MoE, the others dense (Llama 4 Maverick: 2); 1 = each after the first

    @classmethod
    def from_config(cls, c) -> "MoE | None":
        """None for a dense model (num_experts 1)."""
        if c["num_experts"] == 1:
            return None
        return cls(c["num_experts"], c["num_experts_per_tok"], GatedMLP.from_config(c, moe_width(c)),
                   c["shared_experts"], c["first_num_dense_layers"], c["routed_score_func"], c["norm_topk_prob"],
                   c["routed_bias"], c["routed_scaling_factor"], c["router_logit_bias"], max(c["n_routing_groups"], 0),
                   max(c["topk_routing_group"], 0), interleave=c["interleave_moe_layer_step"])

    @property
    def shared(self) -> GatedMLP:
        return dataclasses.replace(self.expert, width=self.shared_experts * self.expert.width)

    def params(self, embed: int, active: bool = False) -> int:
        """`active`: those a token uses (its top-k of the routed experts), and no balancing bias."""
        e, routed = self.num_experts, self.experts_per_token if active else self.num_experts
        shared = self.shared.params(embed) if self.shared_experts else 0
        return (embed * e + routed * self.expert.params(embed) + shared + (e if self.routed_bias and not active else 0)
                + (e if self.logit_bias else 0))

    def flops(self, embed: int, active: bool = True) -> float:
        """Matmul FLOPs per token: the router and the experts a token uses (with active=False, every one)."""
        routed = self.experts_per_token if active else self.num_experts
        return self.expert.flops(embed) * (routed + self.shared_experts) + 2 * embed * self.num_experts

    def hf_tensors(self, embed: int, fused: bool, router: str, gate: str, up: str, down: str) -> list[Tensor]:
        """The router and the experts: in the file layout under the family's names ("{e}" marks the expert),
        or with `fused` in transformers 5's in-memory layout, which it also loads from files (import only)."""
        d, e, f, T = embed, self.num_experts, self.expert.width, transposed
        swap = lambda x: x.transpose(0, 2, 1)  # noqa: E731  [E, out, in] <-> [E, in, out]
        if fused:
            return [Tensor(("mlp", "router"), "mlp.gate.weight", (e, d), T, T),
                    Tensor(("mlp", "wi_gate"), "mlp.experts.gate_up_proj", (e, 2 * f, d), lambda x: swap(x[:, :f]),
                           None),
                    Tensor(("mlp", "wi_up"), "mlp.experts.gate_up_proj", (e, 2 * f, d), lambda x: swap(x[:, f:]),
                           None),
                    Tensor(("mlp", "wo"), "mlp.experts.down_proj", (e, d, f), swap, None)]
        return [Tensor(("mlp", "router"), router, (e, d), T, T),
                Tensor(("mlp", "wi_gate"), gate, (f, d), T, T, experts=e),
                Tensor(("mlp", "wi_up"), up, (f, d), T, T, experts=e),
                Tensor(("mlp", "wo"), down, (d, f), T, T, experts=e)]
