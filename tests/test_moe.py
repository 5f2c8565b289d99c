"""Mixture of experts (maxtrain/models/moe.py): routing against a per-token reference, the capacity rule, the
grouped matmuls, and training that gives the same losses on every mesh (expert, fsdp, tensor, data)."""

import dataclasses
import json
import math
import os
import subprocess

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import TESTS, TINY
from maxtrain.config import load as config_lib
from maxtrain.config import keys as config_keys
from maxtrain.parallel import mesh as mesh_lib, rules as rules_lib
from maxtrain.models import moe
from maxtrain.models.args import ModelArgs
from maxtrain.models.decoder import Decoder, stack_layers, unstack_layers
from maxtrain.models.layers import MLP
from maxtrain.ops import grouped_matmul as gmm
from maxtrain.parallel.plan import Plan

MOE = ("model_family=mixtral", "num_experts=8", "num_experts_per_tok=2", "norm_topk_prob=true")
# Meshes of the 8 fake devices: (data, fsdp, expert, context, tensor).
MESHES = {"expert1": (1, 8, 1, 1, 1), "expert8": (1, 1, 8, 1, 1), "expert4xfsdp2": (1, 2, 4, 1, 1),
          "expert2xtensor2xdata2": (2, 1, 2, 1, 2)}


def mesh_overrides(shape):
    return [f"ici_{a}_parallelism={n}" for a, n in zip(("data", "fsdp", "expert", "context", "tensor"), shape)]


def with_plan(args, **changes):
    """args whose execution plan (chunks, grouped matmul) has `changes`."""
    return dataclasses.replace(args, plan=dataclasses.replace(args.plan, **changes))


def with_moe(args, **changes):
    """args whose MoE part has `changes`."""
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **changes))


def block_args(tiny_config, *overrides, **changes):
    """The tiny MoE's args, with `changes` to its execution plan's fields, its own or its MoE part's."""
    c = tiny_config(*MOE, *overrides)
    planned, own = {f.name for f in dataclasses.fields(Plan)}, {f.name for f in dataclasses.fields(ModelArgs)}
    args = with_plan(ModelArgs.from_config(c), **{k: v for k, v in changes.items() if k in planned})
    args = dataclasses.replace(args, **{k: v for k, v in changes.items() if k in own})
    return with_moe(args, **{k: v for k, v in changes.items() if k not in planned | own}), c


def init_block(args, x):
    return nn.meta.unbox(moe.MoEBlock(args).init(jax.random.key(0), x)["params"])


def apply_block(args, params, x, c=None, shape=None):
    """The block's output, jitted; with a mesh shape, under that mesh and the config's rules."""
    fn = jax.jit(lambda p, x: moe.MoEBlock(args).apply({"params": p}, x))
    if shape is None:
        return np.asarray(fn(params, x))
    mesh = Mesh(np.asarray(jax.devices()).reshape((1, *shape)), mesh_lib.MESH_AXES)  # stage 1
    with mesh_lib.activate(mesh, rules_lib.axis_rules(c)):
        return np.asarray(fn(params, x))


def reference(args, params, x, keep=None):
    """Loop over tokens in float64 numpy: score the experts, take the top k, sum their SwiGLUs."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    xs = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    out = np.zeros_like(xs)
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    for t, x_t in enumerate(xs):
        logits = x_t @ p["router"]
        scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum() \
            if args.moe.score_func == "softmax" else 1 / (1 + np.exp(-logits))
        chosen = np.argsort(-scores)[:args.moe.experts_per_token]
        weights = scores[chosen] / (scores[chosen].sum() if args.moe.norm_topk_prob else 1.0)
        for rank, (e, w) in enumerate(zip(chosen, weights * args.moe.scaling_factor)):
            if keep is not None and not keep[t, rank]:
                continue
            h = silu(x_t @ p["wi_gate"][e]) * (x_t @ p["wi_up"][e])
            out[t] += w * (h @ p["wo"][e])
    return out.reshape(x.shape)


def random_x(args, batch=8, length=16, seed=1):
    return jax.random.normal(jax.random.key(seed), (batch, length, args.embed), jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["blocked", "ragged_dot", "tokamax"])
def test_one_expert_top1_equals_the_dense_mlp(tiny_config, method):
    args, _ = block_args(tiny_config, moe_grouped_matmul=method, num_experts=1, experts_per_token=1)
    x = random_x(args)
    params = init_block(args, x)
    dense = {"wi_gate": params["wi_gate"][0], "wi_up": params["wi_up"][0], "wo": params["wo"][0]}
    expected = jax.jit(lambda p, x: MLP(args).apply({"params": p}, x))(dense, x)
    np.testing.assert_allclose(apply_block(args, params, x), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("routing", [
    {}, {"norm_topk_prob": False}, {"score_func": "sigmoid", "scaling_factor": 2.5},
    {"experts_per_token": 8}, {"experts_per_token": 1}], ids=["softmax_norm", "softmax", "sigmoid", "top8", "top1"])
@pytest.mark.parametrize("method", ["blocked", "ragged_dot", "tokamax"])
def test_dropless_equals_a_per_token_reference(tiny_config, routing, method):
    args, _ = block_args(tiny_config, moe_grouped_matmul=method, **routing)
    x = random_x(args)
    params = init_block(args, x)
    np.testing.assert_allclose(apply_block(args, params, x), reference(args, params, x), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_dropless_on_every_mesh_equals_the_reference(tiny_config, mesh):
    args, c = block_args(tiny_config, *mesh_overrides(MESHES[mesh]))
    x = random_x(args)
    params = init_block(args, x)
    np.testing.assert_allclose(apply_block(args, params, x, c, MESHES[mesh]), reference(args, params, x),
                               atol=1e-5, rtol=1e-5)


def capacity_reference(experts_BxLxK, num_experts, cap):
    """Per sequence: every token's first choice in position order, then every second choice, ...; an
    expert keeps an assignment while it has taken fewer than `cap`."""
    b, length, k = experts_BxLxK.shape
    keep = np.zeros((b, length, k), bool)
    for s in range(b):
        taken = np.zeros(num_experts, int)
        for rank in range(k):
            for pos in range(length):
                e = experts_BxLxK[s, pos, rank]
                keep[s, pos, rank] = taken[e] < cap
                taken[e] += 1
    return keep


def chosen_experts(args, params, x):
    (_, experts), _ = moe.MoEBlock(args).apply({"params": params}, x, params["router"], None,
                                                method=moe.MoEBlock.route, mutable=["intermediates"])
    return np.asarray(experts)


@pytest.mark.parametrize("mesh", [None, "expert8", "expert2xtensor2xdata2"])
def test_capacity_drops_exactly_what_the_definition_says(tiny_config, mesh):
    args, c = block_args(tiny_config, *mesh_overrides(MESHES[mesh or "expert1"]), capacity_factor=0.5)
    x = random_x(args)
    params = init_block(args, x)
    cap = moe.capacity(args.moe, args.capacity_factor, x.shape[1])
    assert cap == math.ceil(0.5 * 16 * 2 / 8) == 2
    dropless = dataclasses.replace(args, capacity_factor=-1.0)
    keep = capacity_reference(chosen_experts(dropless, params, x), args.moe.num_experts, cap)
    assert 0 < keep.mean() < 1  # some dropped, some kept
    np.testing.assert_array_equal(chosen_experts(args, params, x) < args.moe.num_experts, keep)
    out = apply_block(args, params, x, c, MESHES[mesh] if mesh else None)
    np.testing.assert_allclose(out, reference(args, params, x, keep.reshape(-1, 2)), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("capacity_factor", [-1.0, 0.5])
def test_chunks_of_positions_equal_the_whole_sequence(tiny_config, capacity_factor):
    args, c = block_args(tiny_config, *mesh_overrides(MESHES["expert4xfsdp2"]), capacity_factor=capacity_factor)
    x = random_x(args)
    params = init_block(args, x)
    whole = apply_block(args, params, x, c, MESHES["expert4xfsdp2"])
    chunked = apply_block(with_plan(args, moe_chunk=4), params, x, c, MESHES["expert4xfsdp2"])
    np.testing.assert_allclose(chunked, whole, atol=1e-6)


@pytest.mark.slow
def test_chunks_of_positions_give_the_whole_sequences_gradients(tiny_config):
    args, c = block_args(tiny_config, *mesh_overrides(MESHES["expert4xfsdp2"]))
    x = random_x(args)
    params = init_block(args, x)
    mesh = Mesh(np.asarray(jax.devices()).reshape((1, *MESHES["expert4xfsdp2"])), mesh_lib.MESH_AXES)

    def grads(a):
        loss = lambda p, x: jnp.sum(jnp.sin(moe.MoEBlock(a).apply({"params": p}, x)))  # noqa: E731
        with mesh_lib.activate(mesh, rules_lib.axis_rules(c)):
            return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    chunked = grads(with_plan(args, moe_chunk=4))
    for whole, chunk in zip(jax.tree.leaves(grads(args)), jax.tree.leaves(chunked)):
        np.testing.assert_allclose(chunk, whole, atol=1e-5, rtol=1e-5)


def test_a_large_capacity_equals_dropless(tiny_config):
    args, c = block_args(tiny_config, *mesh_overrides(MESHES["expert4xfsdp2"]), capacity_factor=4.0)
    x = random_x(args)
    params = init_block(args, x)
    dropless = apply_block(dataclasses.replace(args, capacity_factor=-1.0), params, x, c, MESHES["expert4xfsdp2"])
    np.testing.assert_allclose(apply_block(args, params, x, c, MESHES["expert4xfsdp2"]), dropless, atol=1e-6)


@pytest.mark.slow
def test_blocked_and_tokamax_matmuls_equal_ragged_dot_with_gradients():
    rng = np.random.default_rng(0)
    sizes = jnp.array([0, 70, 1, 0, 129, 3], jnp.int32)  # empty groups, partial blocks, 17 rows past all groups
    x = jnp.asarray(rng.normal(size=(220, 24)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 24, 40)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(220, 40)), jnp.float32)

    def grads(method):
        f = lambda x, w: jnp.sum(gmm.grouped_matmul(x, w, sizes, method) * dy)  # noqa: E731
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)
    (v1, (dx1, dw1)), (v2, (dx2, dw2)) = grads("blocked"), grads("ragged_dot")
    np.testing.assert_allclose(v1, v2, rtol=1e-5)
    np.testing.assert_allclose(dx1, dx2, atol=1e-4)
    np.testing.assert_allclose(dw1, dw2, atol=1e-4)
    assert not np.any(np.asarray(gmm.grouped_matmul(x, w, sizes, "blocked"))[203:])  # rows past the groups
    (v3, (dx3, dw3)) = grads("tokamax")  # on CPU Tokamax's XLA implementation: ragged_dot's bits
    np.testing.assert_array_equal(v3, v2)
    np.testing.assert_array_equal(dx3, dx2)
    np.testing.assert_array_equal(dw3, dw2)
    assert not np.any(np.asarray(gmm.grouped_matmul(x, w, sizes, "tokamax"))[203:])


DEEPSEEK_TINY = ("model_family=deepseek", "num_experts=8", "num_experts_per_tok=2", "shared_experts=1",
                 "first_num_dense_layers=1", "routed_score_func=sigmoid", "norm_topk_prob=true",
                 "routed_scaling_factor=2.5", "routed_bias=true", "base_moe_mlp_dim=32", "base_num_decoder_layers=3")


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [MOE, DEEPSEEK_TINY], ids=["mixtral", "deepseek"])
def test_parameter_count_and_scan_equals_unrolled(tiny_config, overrides):
    c = tiny_config(*overrides)
    args = ModelArgs.from_config(c)
    tokens = jax.random.randint(jax.random.key(1), (2, c.max_target_length), 0, c.vocab_size)
    params = jax.jit(lambda k: nn.meta.unbox(Decoder(args).init(k, tokens)["params"]))(jax.random.key(0))
    assert sum(x.size for x in jax.tree.leaves(params)) == c.num_params
    assert c.num_active_params < c.num_params
    unrolled = Decoder(dataclasses.replace(args, scan_layers=False))
    flat = unstack_layers(params, args)
    np.testing.assert_allclose(jax.jit(Decoder(args).apply)({"params": params}, tokens),
                               jax.jit(unrolled.apply)({"params": flat}, tokens), atol=1e-5, rtol=1e-5)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, params, stack_layers(flat, args)))


def test_deepseek_preset_counts_like_its_model():
    """Its total and active parameters, from the model's own shapes (test_presets: against transformers')."""
    c = config_lib.load([str(config_lib.BASE_YML), "model_name=deepseek-v3", "attention=dot_product",
                         "mlp_chunk_size=0"])
    args = ModelArgs.from_config(c)
    shapes = jax.eval_shape(lambda: nn.meta.unbox(Decoder(args).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"])) == c.num_params
    experts = shapes["params"]["moe_layers"]["mlp"]
    unused = sum(math.prod(experts[w].shape) for w in ("wi_gate", "wi_up", "wo")) * (256 - 8) // 256
    assert c.num_active_params == c.num_params - unused - math.prod(experts["router_bias"].shape)


@pytest.mark.parametrize("method", ["megablox"])
def test_the_tpu_kernel_equals_blocked_in_the_interpreter(monkeypatch, method):
    monkeypatch.setattr(gmm, "MEGABLOX_INTERPRET", True)
    rng = np.random.default_rng(0)
    sizes = jnp.array([0, 100, 7, 0, 121], jnp.int32)  # 28 rows past all groups
    x = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 128, 128)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)

    def grads(method):
        f = lambda x, w: jnp.sum(gmm.grouped_matmul(x, w, sizes, method) * dy)  # noqa: E731
        return jax.value_and_grad(f, argnums=(0, 1))(x, w)
    (v1, (dx1, dw1)), (v2, (dx2, dw2)) = grads(method), grads("blocked")
    np.testing.assert_allclose(v1, v2, rtol=1e-4)
    np.testing.assert_allclose(dx1, dx2, atol=1e-3)
    np.testing.assert_allclose(dw1, dw2, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["megablox", "tokamax"])
def test_the_tpu_kernel_swiglu_masks_only_its_ends(monkeypatch, method):
    """megablox_swiglu and tokamax_swiglu select rows past the groups away only before the first and after
    the last matmul: NaN in those rows of x and of the output's gradient reaches neither the result nor any
    gradient."""
    monkeypatch.setattr(gmm, "MEGABLOX_INTERPRET", True)
    rng = np.random.default_rng(1)
    sizes = jnp.array([60, 0, 100, 7], jnp.int32)  # 89 rows past all groups
    x = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32).at[167:].set(jnp.nan)
    ws = tuple(jnp.asarray(rng.normal(size=s) / 12, jnp.float32) for s in ((4, 128, 128), (4, 128, 128), (4, 128, 128)))
    dy = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32).at[167:].set(jnp.nan)

    def body(x, matmul):
        return matmul(nn.silu(matmul(x, 0)) * matmul(x, 1), 2)

    def run_vjp(run, cotangent):
        y, vjp = jax.vjp(lambda x, ws: run(x, sizes, ws, body), x, ws)
        return y, *vjp(cotangent)
    y1, dx1, dw1 = run_vjp(gmm.grouped_swiglu(method, "cpu"), dy)  # NaN in dy's rows past the groups too
    y2, dx2, dw2 = run_vjp(gmm.blocked_swiglu, jnp.where(jnp.isnan(dy), 0, dy))
    assert not np.any(np.asarray(y1)[167:]) and not np.any(np.asarray(dx1)[167:])
    np.testing.assert_allclose(y1, y2, atol=1e-4)
    np.testing.assert_allclose(dx1, dx2, atol=1e-3)
    for a, b in zip(dw1, dw2):
        np.testing.assert_allclose(a, b, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [m for m in MESHES if m != "expert1"])
def test_the_same_losses_on_every_mesh(train_tiny, reference_losses, mesh):
    """5 steps of training, float32: rtol 1e-5 (the same sums in other orders; no routing decision flips), each
    mesh against fsdp 8 (no expert parallelism)."""
    expert1 = reference_losses(*MOE, *mesh_overrides(MESHES["expert1"]), n_devices=8)
    assert expert1[-1] < expert1[0]
    losses = train_tiny(*MOE, *mesh_overrides(MESHES[mesh]), f"run_name={mesh}")["losses"]
    np.testing.assert_allclose(losses, expert1, rtol=1e-5, err_msg=mesh)


@pytest.mark.slow
def test_metrics_resume_and_accumulation(train_tiny, tmp_path):
    """Expert load per layer in metrics.jsonl; a resumed run continues exactly; accumulation equals one batch
    (with no balancing loss in the gradient: its batch statistics are per micro-batch; it is still reported)."""
    common = (*MOE, *mesh_overrides(MESHES["expert4xfsdp2"]), "steps=6", "learning_rate_schedule_steps=6",
              "load_balance_loss_weight=0", "per_device_batch_size=2")
    straight = train_tiny(*common, "run_name=straight")["losses"]
    rows = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    load = np.asarray(rows[-1]["train/expert_load"])
    assert load.shape == (2, 8) and np.allclose(load.sum(axis=1), 1.0)
    assert rows[-1]["train/moe_lb_loss"] >= 2.0 - 1e-6  # top-k at perfect balance, more otherwise
    ckpt = ("enable_checkpointing=true", "checkpoint_period=3", "run_name=resumed")
    train_tiny(*common, *ckpt, "steps=3")
    resumed = train_tiny(*common, *ckpt)["losses"]
    np.testing.assert_allclose(resumed, straight[3:], rtol=1e-5)
    two = train_tiny(*common, "gradient_accumulation_steps=2", "run_name=two")["losses"]
    np.testing.assert_allclose(two, straight, rtol=1e-5)


@pytest.mark.slow
def test_deepseek_style_bias_moves_towards_balance(train_tiny):
    """... and moves the same with the weights and the optimizer state in host memory (the biases come in for
    their update after the streamed one)."""
    common = (*DEEPSEEK_TINY, "routed_bias_update_rate=0.01", "steps=4", "capacity_factor=1.5")
    out = train_tiny(*common, "run_name=plain")
    bias = np.asarray(out["state"].params["moe_layers"]["mlp"]["router_bias"])
    assert bias.shape == (2, 8)
    # every step moves every expert's bias by exactly +-rate (or 0 at exactly the mean load)
    assert np.all(np.abs(bias) <= 4 * 0.01 + 1e-6) and np.any(bias != 0)
    assert np.all(np.isfinite(out["losses"]))
    offloaded = train_tiny(*common, "run_name=offloaded", "optimizer_memory_host_offload=true",
                           "parameter_memory_host_offload=true")["state"].params
    np.testing.assert_array_equal(offloaded["moe_layers"]["mlp"]["router_bias"], bias)
    for a, b in zip(jax.tree.leaves(offloaded), jax.tree.leaves(out["state"].params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_update_router_bias_raises_underloaded_experts():
    params = {"moe_layers": {"mlp": {"router_bias": jnp.zeros((1, 4))}}}
    loads = {"moe_layers": {"mlp": {"expert_load": (jnp.array([[0.1, 0.4, 0.25, 0.25]]),)}}}
    new = moe.update_router_bias(params, loads, 0.5)["moe_layers"]["mlp"]["router_bias"]
    np.testing.assert_array_equal(new, [[0.5, -0.5, 0.0, 0.0]])


@pytest.mark.parametrize("overrides,key", [
    (("model_family=mixtral", "num_experts=4", "num_experts_per_tok=5"), "num_experts_per_tok"),
    (("model_family=mixtral", "num_experts=6", "num_experts_per_tok=2", "ici_expert_parallelism=4",
      "ici_fsdp_parallelism=2"), "num_experts"),
    (("model_family=mixtral", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=30",
      "ici_tensor_parallelism=4",
      "ici_fsdp_parallelism=2", "base_num_query_heads=4", "base_num_kv_heads=4"), "base_moe_mlp_dim"),
    (("shared_experts=1",), "shared_experts"),
    (("model_family=deepseek", "num_experts=8", "first_num_dense_layers=2"), "first_num_dense_layers"),
    (("model_family=deepseek", "num_experts=8", "routed_score_func=relu"), "routed_score_func"),
    (("num_experts=0",), "num_experts"),
])
def test_bad_moe_configs_name_the_key(tiny_config, overrides, key):
    with pytest.raises(config_keys.ConfigError) as e:
        tiny_config(*overrides)
    assert e.value.key == key and "\n" not in str(e.value)


@pytest.mark.slow
def test_two_processes_with_experts_across_them_match_one(tmp_path, train_tiny):
    """Expert parallelism over both processes (dcn expert=2 x ici expert=4): the all_to_alls cross processes."""
    env = dict(os.environ, MAXTRAIN_LOG_DIR=str(tmp_path / "logs"), MAXTRAIN_DEVICES_PER_PROCESS="4")
    proc = subprocess.run([str(TESTS.parent / "scripts" / "launch_local.sh"), "2", TINY, f"base_output_directory={tmp_path}",
                           "run_name=multi", "log_period=1", *MOE, "ici_expert_parallelism=4", "ici_fsdp_parallelism=1",
                           "dcn_data_parallelism=1", "dcn_expert_parallelism=2"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=TESTS.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    multi = [json.loads(x) for x in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
    multi = [r["train/loss"] for r in multi if "start" not in r]
    single = train_tiny(*MOE, *mesh_overrides(MESHES["expert8"]), "run_name=single")["losses"]
    np.testing.assert_allclose(multi, single, rtol=1e-5)
