"""Train state, loss, sharded init and the jitted train step.

`build(config, mesh)` returns everything the loop needs: the model, the state's shardings, a jitted
init that creates parameters and optimizer state directly in their shards, and a jitted train step
with explicit in/out shardings and donated state.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import flax.linen as nn
import flax.struct
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.transforms import MaskedNode
from jax.sharding import NamedSharding, PartitionSpec

from maxtrain.ops import attention
from maxtrain.training import loss, offload
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.models import moe, mtp, quantization
from maxtrain.config.load import Config
from maxtrain.data import rows
from maxtrain.data.rows import BATCH_DTYPES
from maxtrain.models.decoder import Decoder
from maxtrain.models import registry
from maxtrain.training.optimizer import learning_rate_schedule, make_optimizer
from maxtrain.parallel import pipeline, rules as rules_lib


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def loss_fn(params, model: Decoder, batch: dict, z_loss_multiplier: float = 0.0, loss_chunk_size: int = 0,
            moe_weights: tuple[float, float] = (0.0, 0.0), scale: float | jax.Array = 1.0,
            mtp_factor: float | None = None):
    """Summed masked cross-entropy (+ optional z-loss, + an MoE's auxiliary losses with `moe_weights`:
    load balance, router z) times `scale`, and the number of target tokens. With `mtp_factor` (and the
    model's multi-token prediction depths, their arrays in the batch: mtp.shifted) the depths' summed
    cross-entropy, averaged over the depths, times mtp_factor, joins it; None: the depths do not run (eval).

    Sums, not means, so micro-batches add up to exactly the large-batch loss. The train step passes
    1 / (the whole batch's tokens) as `scale`, so its gradients come out as means: divided afterwards,
    XLA wrote them out once more before the update (gigabytes per chip at Mixtral's size). The
    metrics in aux stay sums, times the tokens for an MoE's statistics.
    """
    a = model.args
    inputs = (batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
    weights_BxL = batch["weights"].astype(jnp.float32)
    depths = a.mtp_layers if mtp_factor is not None else 0
    outputs, recorded = model.apply({"params": params}, *inputs, return_hidden=True,
                                    mtp_tokens_MxBxL=mtp.depth_tokens(batch, depths), mutable=["intermediates"])
    x_BxLxD, out_DxV = outputs[:2]
    chunk = loss_chunk_size or x_BxLxD.shape[1]
    total, ce_sum = loss.cross_entropy_loss(x_BxLxD, out_DxV, batch["targets"], weights_BxL, chunk,
                                            a.logits_dot_in_fp32, z_loss_multiplier, a.vocab.size, a.vocab.logit_softcap)
    tokens = jnp.sum(weights_BxL)
    aux = {"loss_sum": ce_sum, "tokens": tokens}
    if depths:  # multi-token prediction: each depth's targets lie k further ahead
        mtp_sum, mtp_tokens = jnp.zeros(()), jnp.zeros(())
        for k, h_BxLxD in enumerate(outputs[2], 1):
            weights_k = batch[f"mtp_weights_{k}"].astype(jnp.float32)
            depth_total, depth_sum = loss.cross_entropy_loss(h_BxLxD, out_DxV, batch[f"mtp_targets_{k}"], weights_k,
                                                             chunk, a.logits_dot_in_fp32, 0.0, a.vocab.size,
                                                             a.vocab.logit_softcap)
            total = total + mtp_factor / depths * depth_total
            mtp_sum, mtp_tokens = mtp_sum + depth_sum, mtp_tokens + jnp.sum(weights_k)
        aux |= {"mtp_loss_sum": mtp_sum, "mtp_tokens": mtp_tokens}
    if model.args.moe is not None:
        layers = recorded["intermediates"]
        lb, z = jnp.mean(moe.collect(layers, "lb_loss")), jnp.mean(moe.collect(layers, "z_loss"))
        total = total + tokens * (moe_weights[0] * lb + moe_weights[1] * z)
        aux |= {"moe_lb_loss": lb * tokens, "moe_z_loss": z * tokens,
                "moe_load": jax.tree.map(lambda x: x * tokens, layers)}
        if model.args.capacity_factor > 0:
            aux["moe_dropped"] = jnp.mean(moe.collect(layers, "dropped")) * tokens
    return total * scale, aux


def load_balancer(c: Config) -> Callable[[dict], dict]:
    """Under context parallelism with context_parallel_load_balance, the batch in zigzag order along its
    positions (attention.zigzag_order), every [B, L] array alike: each context shard gets the same
    causal attention work, and the loss, a masked sum over positions, is the same number."""
    shards = rules_lib.sequence_shards(c.logical_axis_rules, c.mesh_shape)
    if shards == 1 or not c.context_parallel_load_balance:
        return lambda batch: batch
    order = attention.zigzag_order(c.max_target_length, shards)
    return lambda batch: {k: v[:, order] for k, v in batch.items()}


@dataclasses.dataclass
class Trainer:
    model: Decoder
    optimizer: optax.GradientTransformation
    mesh: Any
    rules: tuple
    state_shardings: TrainState
    param_logical_specs: Any
    batch_sharding: NamedSharding
    init: Callable[[jax.Array], TrainState]
    train_step: Callable[[TrainState, dict], tuple[TrainState, dict]]
    eval_step: Callable[[Any, dict], dict]
    abstract_state: TrainState
    global_batch_shape: tuple[int, int]
    notes: list[str] = dataclasses.field(default_factory=list)  # for the log: the pipeline, uneven dimensions
    # A state (or params) between the run's layer order and the model's, which checkpoints hold: the
    # circular pipeline keeps each stage's layers together (pipeline.storage_order); else the identity.
    to_saved: Callable[[Any], Any] = lambda tree: tree  # noqa: E731 (the identity: _same, defined below)
    to_run: Callable[[Any], Any] = lambda tree: tree

    mixed: bool = False  # the batch carries each token's source (data_sources): the step counts them

    def abstract_batch(self) -> dict:
        """Shapes, dtypes and shardings of one global batch, for lowering without data."""
        dtypes = {**BATCH_DTYPES, **({"source_ids": np.int32} if self.mixed else {})}
        return {k: jax.ShapeDtypeStruct(self.global_batch_shape, dtype, sharding=self.batch_sharding)
                for k, dtype in dtypes.items()}

    def lower_train_step(self):
        """`train_step` traced for the state and batch layout, without any data. On the main thread:
        tracing builds Flax's lifted module classes (nn.scan, nn.remat), and two threads doing that at
        once corrupt each other's dataclass fields (a KeyError: 'name' in flax's kw_only_dataclasses)."""
        with mesh_lib.activate(self.mesh, self.rules):
            return self.train_step.lower(self.abstract_state, self.abstract_batch())

    def compile_train_step(self, lowered=None):
        """`train_step` compiled ahead of time (from `lowered`, else traced here).

        Safe on a thread given `lowered`: the loop compiles while the state is initialized, and
        calling the result with anything of another shape or sharding is an error rather than a
        silent recompile.
        """
        return (lowered if lowered is not None else self.lower_train_step()).compile()


def build(c: Config, mesh) -> Trainer:
    model = quantization.quantize(registry.spec_for(c).build(c), c)
    rules = rules_lib.axis_rules(c)
    dummy_tokens = jnp.zeros((1, c.max_target_length), jnp.int32)

    to_run_order, to_model_order = _layer_orders(model)

    def state_of(params) -> TrainState:  # params in the model's layer order
        params = to_run_order(params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    def init_state(rng) -> TrainState:
        return state_of(nn.meta.unbox(model.init(rng, dummy_tokens)["params"]))

    rng = jax.random.key(c.init_weights_seed)
    boxed = jax.eval_shape(model.init, rng, dummy_tokens)["params"]
    param_specs = nn.get_partition_spec(boxed)
    tx = make_optimizer(c, param_specs)
    param_shapes = nn.meta.unbox(boxed)
    param_shardings = rules_lib.param_shardings(param_specs, param_shapes, mesh, rules)
    notes = rules_lib.uneven_notes(param_specs, param_shapes, rules, dict(mesh.shape))
    offloaded = [k for k in ("optimizer_memory_host_offload", "parameter_memory_host_offload") if c[k]]
    if offloaded and mesh.devices.flat[0].platform == "cpu":
        notes.append(f"{' and '.join(offloaded)}: no effect on CPU (its device memory is the host's); the state goes "
                     "to pinned_host memory and back as on TPU and GPU")
    if model.args.plan.schedule.active:
        notes.insert(0, pipeline.placement([(s.name, s.count, s.moe) for s in model.args.stacks()],
                                           model.args.plan.schedule))
    abstract = jax.eval_shape(state_of, param_shapes)  # not init_state: one trace of the model fewer
    replicated = rules_lib.replicated(mesh)
    # Optimizer moments are shaped like the params and sharded like them; counters are replicated.
    # (Muon's two sides each hold MaskedNodes where the other side's parameters are.)
    opt_shardings = optax.tree_map_params(
        tx, lambda leaf, sharding: leaf if isinstance(leaf, MaskedNode) else sharding, abstract.opt_state,
        param_shardings, transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, MaskedNode))
    on_device = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
    # Host offload: the state's home is pinned host memory; the step brings it in and its outputs go back.
    state_shardings = on_device.replace(
        params=_on_host(param_shardings) if c.parameter_memory_host_offload else param_shardings,
        opt_state=_on_host(opt_shardings) if c.optimizer_memory_host_offload else opt_shardings)

    batch_sharding = rules_lib.sharding_for(("batch", "length"), mesh, rules)
    # On CPU most of the compile time goes to LLVM, and at level 1 it takes less of it; the step runs
    # as fast (its matmuls are library calls), equal to the default's results up to float32 rounding.
    # A level set in XLA_FLAGS wins (the tests compile at 0): options given here would override it.
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    level_set = "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
    cpu_compile = {"xla_backend_optimization_level": 1} if on_cpu and not level_set else None
    init = jax.jit(init_state, out_shardings=state_shardings, compiler_options=cpu_compile)
    step_fn = _make_step(c, model, tx, mesh, on_device, state_shardings, batch_sharding)
    train_step = jax.jit(step_fn, in_shardings=(state_shardings, batch_sharding),
                         out_shardings=(state_shardings, replicated), donate_argnums=0,
                         compiler_options=cpu_compile)
    balance = load_balancer(c)
    def evaluate(params, batch):
        params = jax.device_put(params, param_shardings)
        return {k: v for k, v in loss_fn(params, model, balance(batch), 0.0, c.loss_chunk_size)[1].items()
                if k in ("loss_sum", "tokens")}
    eval_step = jax.jit(evaluate, in_shardings=(state_shardings.params, batch_sharding), out_shardings=replicated,
                        compiler_options=cpu_compile)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, state_shardings)
    trainer = Trainer(model, tx, mesh, rules, state_shardings, param_specs, batch_sharding, init,
                      train_step, eval_step, abstract, (c.global_batch_size, c.max_target_length), notes,
                      mixed=bool(c.data_sources))
    if to_run_order is not _same:
        def convert(fn, donate):  # for a state or its params: runs once per save or restore
            def in_device_memory(device):  # the tree from its home (host memory, where offloaded)
                return lambda tree: fn(jax.device_put(tree, device))
            jitted = {kind: jax.jit(in_device_memory(device), out_shardings=shardings,
                                    donate_argnums=(0,) if donate else ())
                      for kind, device, shardings in (("state", on_device, state_shardings),
                                                      ("params", param_shardings, state_shardings.params))}
            return lambda tree: jitted["state" if isinstance(tree, TrainState) else "params"](tree)
        trainer.to_saved, trainer.to_run = convert(to_model_order, False), convert(to_run_order, True)
    return trainer


def _on_host(shardings):
    return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings)


def _same(tree):
    return tree


def _layer_orders(model) -> tuple[Callable, Callable]:
    """(model order -> the run's, the run's -> model order) for params or a state: the circular
    pipeline's storage order of its stack, else the identity both ways."""
    schedule = model.args.plan.schedule
    if schedule.repeats == 1:
        return _same, _same
    name, count = model.args.stacks()[-1].name, model.args.stacks()[-1].count
    return (functools.partial(pipeline.to_storage_order, names={name}, layers=count, schedule=schedule),
            functools.partial(pipeline.to_model_order, names={name}, layers=count, schedule=schedule))


def _make_step(c: Config, model, tx, mesh, on_device: TrainState, home: TrainState, batch_sharding):
    param_shardings = on_device.params
    accum = c.gradient_accumulation_steps
    schedule = learning_rate_schedule(c)
    grad_fn = functools.partial(jax.value_and_grad(loss_fn, has_aux=True), model=model, z_loss_multiplier=c.z_loss_multiplier,
                                loss_chunk_size=c.loss_chunk_size,
                                moe_weights=(c.load_balance_loss_weight, c.router_z_loss_weight),
                                mtp_factor=c.mtp_loss_scaling_factor)
    micro_sharding = NamedSharding(mesh, PartitionSpec(None, *batch_sharding.spec))
    pipelined = model.args.plan.schedule
    if pipelined.repeats > 1:  # the MoE stack's records come in the circular schedule's order: metrics by layer
        count = model.args.stacks()[-1].count
        back = np.argsort(pipeline.storage_order(count, pipelined.stages, pipelined.repeats))
        layer_order = lambda per_layer: per_layer[back]  # noqa: E731
    else:
        layer_order = _same

    def micro_batches(batch):
        # Row r goes to micro-batch r % accum, so every device holds a slice of every micro-batch.
        def split(x_BxL):
            x = x_BxL.reshape(x_BxL.shape[0] // accum, accum, *x_BxL.shape[1:]).swapaxes(0, 1)
            return jax.lax.with_sharding_constraint(x, micro_sharding)
        return jax.tree.map(split, batch)

    balance = load_balancer(c)
    offloaded = c.optimizer_memory_host_offload or c.parameter_memory_host_offload
    sources = len(c.data_sources)

    def step(state: TrainState, batch: dict):
        # A host-offloaded state comes in when needed: a copy of the weights for the forward and backward passes
        # now, each parameter's weights and optimizer state for its update after the gradients (not beside the
        # backward pass's activations).
        params_in = jax.device_put(state.params, on_device.params)
        checksum = rows.checksum(batch, jnp)  # of the batch as the data pipeline made it
        if sources:  # each source's tokens in this batch (the realized mixture), then the model's inputs alone
            source_ids = batch.pop("source_ids")
            drawn = batch["segment_ids"] > 0
            source_tokens = jnp.stack([jnp.sum(drawn & (source_ids == i), dtype=jnp.int32) for i in range(sources)])
        batch = balance(mtp.shifted(batch, c.mtp_num_layers))  # the depths' targets, shifted in sequence order
        tokens = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)
        if accum == 1:
            (_, aux), grads = grad_fn(params_in, batch=batch, scale=1.0 / tokens)
        else:
            def body(carry, micro):
                (_, aux), g = grad_fn(params_in, batch=micro, scale=1.0 / tokens)
                g = jax.lax.with_sharding_constraint(g, param_shardings)
                return jax.tree.map(jnp.add, carry, (g, aux)), None
            first = jax.tree.map(lambda x: x[0], micro_batches(batch))
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                 jax.eval_shape(lambda: (params_in, grad_fn(params_in, batch=first)[0][1])))
            (grads, aux), _ = jax.lax.scan(body, zeros, micro_batches(batch))
        loss, grad_norm = aux["loss_sum"] / tokens, optax.tree.norm(grads)
        moe_layers = jax.tree.map(lambda x: x / tokens, aux.pop("moe_load", None))
        # The non-finite guard: a step whose loss or gradients are not finite leaves params and optimizer
        # state as they were, on device (no host sync). A cond, not a select: as fast as no guard.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        if offloaded:  # the state streams through the device a parameter at a time
            grads = jax.lax.optimization_barrier(grads)  # once the backward pass is done
            params, opt_state = offload.streamed_update(tx, grads, grad_norm, state.opt_state, state.params, finite,
                                                        c.gradient_clipping_threshold, on_device, home)
            if c.routed_bias:
                params = _router_bias_update(params, moe_layers, c.routed_bias_update_rate, finite,
                                             on_device.params, home.params)
        else:
            def update(_):
                updates, opt_state = tx.update(grads, state.opt_state, state.params)
                params = optax.apply_updates(state.params, updates)
                if c.routed_bias:
                    params = moe.update_router_bias(params, moe_layers, c.routed_bias_update_rate)
                return params, opt_state
            params, opt_state = jax.lax.cond(finite, update, lambda _: (state.params, state.opt_state), None)
        metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": schedule(state.step),
                   "tokens": aux["tokens"], "nonfinite": 1.0 - finite.astype(jnp.float32), "batch_checksum": checksum}
        if sources:
            metrics["source_tokens"] = source_tokens
        if "mtp_loss_sum" in aux:  # the depths' mean cross-entropy over their targets
            metrics["mtp_loss"] = aux["mtp_loss_sum"] / jnp.maximum(aux["mtp_tokens"], 1.0)
        if moe_layers is not None:  # per MoE layer, each expert's share of the routed assignments
            metrics |= {k: v / tokens for k, v in aux.items() if k.startswith("moe_")}
            metrics["expert_load"] = layer_order(moe.collect(moe_layers, "expert_load"))
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step


def _router_bias_update(params, moe_layers, rate: float, finite, on_device, home):
    """DeepSeek-V3's bias update after a streamed update: only the router biases come in and go back home."""
    flat, device, home = (traverse_util.flatten_dict(t) for t in (params, on_device, home))
    biases = {path: jax.device_put(x, device[path]) for path, x in flat.items() if path[-1] == "router_bias"}
    moved = traverse_util.flatten_dict(moe.update_router_bias(traverse_util.unflatten_dict(biases), moe_layers, rate))
    flat |= {path: jax.device_put(jnp.where(finite, x, biases[path]), home[path]) for path, x in moved.items()}
    return traverse_util.unflatten_dict(flat)
