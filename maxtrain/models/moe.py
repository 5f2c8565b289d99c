"""Mixture-of-experts MLP: a drop-in for maxtrain.models.layers.MLP. A router picks `num_experts_per_tok` experts per
token; each expert is a gated MLP (SwiGLU, or the model's mlp_activation; biases with mlp_bias); the token's
output is the weighted sum of its experts' outputs.

Routing (softmax or sigmoid scores, top-k, optional renormalisation and DeepSeek-V3's selection bias),
the auxiliary losses and the capacity rule are plain array code over the whole batch, so GSPMD sees
global statistics. The experts' work is the plan's (maxtrain.parallel.experts: per device, assignments
sorted by expert, exchanged under expert parallelism, multiplied by maxtrain.ops.grouped_matmul), so
only the chosen experts' FLOPs are spent.

Shape suffixes as in maxtrain.models.decoder, and: E experts, K experts per token, T tokens on a device, A = T*K
assignments, G experts on a device, F expert width, S rows a device sends to each peer.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models import stacks as stacks_lib
from maxtrain.parallel.axes import EXPERT_WEIGHT_AXES
from maxtrain.models.args import ModelArgs
from maxtrain.models.layers import MLP, activate, bias, dense_weight
from maxtrain.models.parts import MoE
from maxtrain.parallel.rules import constrain


class MoEBlock(nn.Module):
    args: ModelArgs

    @nn.compact
    def __call__(self, x_BxLxD):
        a, mo = self.args, self.args.moe
        e, f = mo.num_experts, mo.expert.width
        router_DxE = self.param("router", nn.with_logical_partitioning(
            nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"), ("embed", None)),
            (a.embed, e), a.weight_dtype)
        bias_E = None
        if mo.routed_bias:  # not trained, moved by the train step (step.py)
            bias_E = self.param("router_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                                (e,), jnp.float32)
        logit_bias_E = None
        if mo.logit_bias:  # trained with the router, float32 as the routing math
            logit_bias_E = self.param("router_logit_bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                                        (None,)), (e,), jnp.float32)
        weights_BxLxK, experts_BxLxK = self.route(x_BxLxD, router_DxE, bias_E, logit_bias_E)

        gate_ExDxF = dense_weight(self, "wi_gate", (e, a.embed, f), EXPERT_WEIGHT_AXES, fan_in=(1,))
        up_ExDxF = dense_weight(self, "wi_up", (e, a.embed, f), EXPERT_WEIGHT_AXES, fan_in=(1,))
        down_ExFxD = dense_weight(self, "wo", (e, f, a.embed), ("experts", "moe_mlp", "embed"), fan_in=(1,))
        biases = None
        if mo.expert.bias:  # each expert's gate and up biases go into the grouped matmuls
            biases = (bias(self, "bi_gate", (e, f), ("experts", "moe_mlp")),
                      bias(self, "bi_up", (e, f), ("experts", "moe_mlp")))
        cap = capacity(mo, a.capacity_factor, x_BxLxD.shape[1]) if a.capacity_factor > 0 else None
        weights_BxLxK = weights_BxLxK.astype(a.dtype)
        y_BxLxD = a.plan.expert_mlp(x_BxLxD, experts_BxLxK, weights_BxLxK, (gate_ExDxF, up_ExDxF, down_ExFxD), cap,
                                    biases, functools.partial(activate, mlp=mo.expert), mo.scale_input)
        if mo.expert.bias:  # the down bias, sum_k w_k bias[e_k], outside the experts' work: added once however the
            # experts' width splits; a dropped assignment (expert e) picks none. The [E, D] bias is made whole
            # on every device first, so its gradient is each device's own tokens summed, then one all-reduce:
            # sharded as stored (its experts on an axis that also splits the batch), XLA:TPU gathered the
            # whole batch's output gradient onto each device for it (11 GiB a chip at gpt-oss-120b's size)
            down_bias_ExD = constrain(bias(self, "bo", (e, a.embed), ("experts", "embed")), (None, None))
            picked_BxLxE = jnp.einsum("blk,blke->ble", weights_BxLxK, jax.nn.one_hot(experts_BxLxK, e, dtype=a.dtype))
            y_BxLxD = y_BxLxD + jnp.einsum("ble,ed->bld", picked_BxLxE, down_bias_ExD)
        if mo.shared_experts:
            y_BxLxD = y_BxLxD + MLP(a, mo.shared, name="shared")(x_BxLxD)
        return y_BxLxD

    def route(self, x_BxLxD, router_DxE, bias_E, logit_bias_E=None):
        """(weights [B,L,K] float32, experts [B,L,K]; num_experts marks a dropped assignment). Records
        each layer's auxiliary losses and expert load as intermediates. `logit_bias_E` (gpt-oss) joins
        the logits before scoring and choosing: softmax, top-k, renormalised is gpt-oss's softmax over
        the top-k logits."""
        a, mo = self.args, self.args.moe
        e, k = mo.num_experts, mo.experts_per_token
        logits_BxLxE = jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32), router_DxE.astype(jnp.float32))
        if logit_bias_E is not None:
            logits_BxLxE = logits_BxLxE + logit_bias_E
        if mo.score_func == "softmax":
            scores_BxLxE = jax.nn.softmax(logits_BxLxE, axis=-1)
            probs_BxLxE = scores_BxLxE
        else:
            scores_BxLxE = jax.nn.sigmoid(logits_BxLxE)
            probs_BxLxE = scores_BxLxE / jnp.sum(scores_BxLxE, axis=-1, keepdims=True)
        choose_BxLxE = scores_BxLxE if bias_E is None else scores_BxLxE + jax.lax.stop_gradient(bias_E)
        if mo.groups:  # DeepSeek's group-limited routing: experts only from the token's best groups
            choose_BxLxE = limit_to_groups(choose_BxLxE, mo.groups, mo.top_groups, mo.score_func == "sigmoid")
        _, experts_BxLxK = jax.lax.top_k(choose_BxLxE, k)
        weights_BxLxK = jnp.take_along_axis(scores_BxLxE, experts_BxLxK, axis=-1)
        if mo.norm_topk_prob:
            weights_BxLxK = weights_BxLxK / (jnp.sum(weights_BxLxK, axis=-1, keepdims=True) + 1e-20)
        weights_BxLxK = weights_BxLxK * mo.scaling_factor

        # Load and the Switch/Mixtral balancing loss over the whole batch: E * sum_e (tokens to e / tokens)
        # * (mean probability of e), k at perfect balance (as HF's and MaxText's). Counting is not differentiable.
        tokens = math.prod(x_BxLxD.shape[:2])
        counts_E = jnp.sum(jax.nn.one_hot(experts_BxLxK, e, dtype=jnp.float32), axis=(0, 1, 2))
        self.sow("intermediates", "expert_load", counts_E / (tokens * k))
        self.sow("intermediates", "lb_loss", e * jnp.sum(counts_E / tokens * jnp.mean(probs_BxLxE, axis=(0, 1))))
        self.sow("intermediates", "z_loss", jnp.mean(jnp.square(jax.nn.logsumexp(logits_BxLxE, axis=-1))))
        if a.capacity_factor > 0:
            length, places = x_BxLxD.shape[1], a.plan.positions_order(x_BxLxD.shape[1])
            cap = capacity(mo, a.capacity_factor, length)
            if places is not None:  # "first" by position: the batch is in zigzag order
                keep_BxLxK = within_capacity(experts_BxLxK[:, np.argsort(places)], e, cap)[:, places]
            else:
                keep_BxLxK = within_capacity(experts_BxLxK, e, cap)
            self.sow("intermediates", "dropped", 1.0 - jnp.mean(keep_BxLxK.astype(jnp.float32)))
            experts_BxLxK = jnp.where(keep_BxLxK, experts_BxLxK, e)
        return weights_BxLxK, experts_BxLxK


def limit_to_groups(choose_BxLxE, groups: int, top_groups: int, best_two: bool):
    """The choice scores with every expert outside the token's `top_groups` best of `groups` equal groups
    at -inf. A group's score: its best two experts' sum (DeepSeek-V3, sigmoid scores) or its best one's
    (DeepSeek-V2, softmax scores), as HF's routers."""
    *lead, e = choose_BxLxE.shape
    grouped_BxLxGxP = choose_BxLxE.reshape(*lead, groups, e // groups)
    if best_two and e // groups > 1:
        group_score_BxLxG = jnp.sum(jax.lax.top_k(grouped_BxLxGxP, 2)[0], axis=-1)
    else:
        group_score_BxLxG = jnp.max(grouped_BxLxGxP, axis=-1)
    _, best_BxLxT = jax.lax.top_k(group_score_BxLxG, top_groups)
    keep_BxLxG = jnp.sum(jax.nn.one_hot(best_BxLxT, groups, dtype=jnp.int32), axis=-2) > 0
    return jnp.where(keep_BxLxG[..., None], grouped_BxLxGxP, -jnp.inf).reshape(choose_BxLxE.shape)


def capacity(mo: MoE, factor: float, length: int) -> int:
    """Assignments each expert takes from one sequence: `factor` (capacity_factor) x its fair share, rounded up."""
    return math.ceil(factor * length * mo.experts_per_token / mo.num_experts)


def within_capacity(experts_BxLxK, num_experts: int, cap: int):
    """True where an assignment is kept: per sequence and expert, the first `cap` assignments, in order of
    choice rank first (every token's first choice before any second choice, as GShard), then position."""
    b, length, k = experts_BxLxK.shape
    onehot_BxAxE = jax.nn.one_hot(experts_BxLxK.swapaxes(1, 2).reshape(b, k * length), num_experts, dtype=jnp.int32)
    rank_BxA = jnp.sum(jnp.cumsum(onehot_BxAxE, axis=1) * onehot_BxAxE, axis=-1)  # 1-based place in its expert
    return (rank_BxA <= cap).reshape(b, k, length).swapaxes(1, 2)


# ---------------------------------------------------------------------------------------------
# What the MoE layers record, for the loss, the metrics and the balancing bias


def collect(intermediates, name: str):
    """The recorded `name` of every MoE layer, in layer order, stacked: [moe layers, ...]; None if none."""
    found = []
    for path, value in traverse_util.flatten_dict(intermediates).items():
        if path[-1] == name:  # scanned stacks carry a leading layers axis; unrolled layers and MTP depths one each
            index, depth = stacks_lib.unrolled_index(path[0]), stacks_lib.mtp_depth(path[0])
            if depth is not None:  # after every layer of the model
                found.append((2**31 + depth, value[0][None]))
            else:
                found.append((-1, value[0]) if index is None else (index, value[0][None]))
    return jnp.concatenate([v for _, v in sorted(found, key=lambda item: item[0])]) if found else None


def update_router_bias(params, intermediates, rate: float):
    """DeepSeek-V3: each layer's bias moves by `rate` up for experts below the mean load, down above it."""
    flat = traverse_util.flatten_dict(params)
    for path, value in traverse_util.flatten_dict(intermediates).items():
        if path[-1] == "expert_load":
            load = value[0]
            bias = path[:-1] + ("router_bias",)
            flat[bias] = flat[bias] + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return traverse_util.unflatten_dict(flat)
