"""What the pipeline keeps for the backward pass, and where its output lands (parallel/pipeline.py): the
scan over iterations keeps each layer's input and only what the layer's remat policy keeps, and the
stack's output is laid out as the batch outside the pipeline (split over stage and fsdp)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import pytest

from maxtrain.parallel import remat
from maxtrain.parallel import pipeline

LAYERS, D, WIDE, B, T = 8, 16, 48, 16, 8  # WIDE: the tagged intermediate's width, no other array has it
RULES = (("batch", ("stage", "fsdp")), ("stage_layers", "stage"), ("length", None), ("embed", None))


def layer_fn(w, x, pos, seg):
    h = checkpoint_name(jnp.tanh(x @ w["wi"]), remat.OUT)  # [b, T, WIDE], saved only where a policy says
    return x + h @ w["wo"], {}


def setup(schedule):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("stage", "fsdp"))
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    weights = {"wi": jax.random.normal(k1, (LAYERS, D, WIDE)) * 0.2,
               "wo": jax.random.normal(k2, (LAYERS, WIDE, D)) * 0.2}
    x = jax.random.normal(k3, (B, T, D))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    seg = jnp.ones((B, T), jnp.int32)

    def loss(w, x, policy):
        y, _ = pipeline.run(layer_fn, w, x, pos, seg, schedule, policy)
        return jnp.sum(y ** 2), y
    return mesh, weights, x, loss


def residual_shapes(policy_name):
    schedule = pipeline.Schedule(stages=2, repeats=2, microbatches=4)
    mesh, weights, x, loss = setup(schedule)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        _, backward = jax.vjp(lambda w: loss(w, x, remat.POLICIES[policy_name])[0], weights)
    return schedule, [tuple(r.shape) for r in jax.tree.leaves(backward)]  # the residuals it closes over


@pytest.mark.slow
def test_full_remat_keeps_layer_inputs_not_the_layers_named_intermediates():
    schedule, shapes = residual_shapes("full")
    per_chunk, b = LAYERS // (schedule.stages * schedule.repeats), B // schedule.microbatches
    assert not [s for s in shapes if len(s) == 6 and s[-1] == WIDE]  # the tagged activation is recomputed
    # each layer's input, every iteration: [iterations, stages, layers per chunk, b, T, D]
    assert (schedule.iterations, schedule.stages, per_chunk, b, T, D) in shapes or \
        (schedule.iterations, per_chunk, schedule.stages, b, T, D) in shapes
    # the weights an iteration selects are never kept per iteration
    assert not [s for s in shapes if s and s[0] == schedule.iterations and s[-2:] in ((D, WIDE), (WIDE, D))]


@pytest.mark.slow
def test_a_policy_that_saves_a_name_keeps_it_in_the_pipeline_too():
    for policy in ("save_out_proj", "none"):  # the tag by name; everything without remat
        schedule, shapes = residual_shapes(policy)
        assert (schedule.iterations, schedule.stages, 2, B // 4, T, WIDE) in shapes, policy
        assert not [s for s in shapes if s[:1] == (schedule.iterations,) and s[-2:] in ((D, WIDE), (WIDE, D))]


def test_output_is_laid_out_as_the_batch_outside():
    schedule = pipeline.Schedule(stages=2, repeats=1, microbatches=4)
    mesh, weights, x, loss = setup(schedule)
    weights = jax.device_put(weights, NamedSharding(mesh, P("stage")))
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        step = jax.jit(lambda w, x: loss(w, x, remat.POLICIES["full"])[1])
        y = step(weights, x)
    assert y.sharding.spec == P(("stage", "fsdp"))


def test_minimal_keeps_the_projections_as_without_the_pipeline():
    """`minimal` keeps matmuls without batch dimensions; under the vmap over stages each has the stage's."""
    schedule, shapes = residual_shapes("minimal")
    # x @ wi's output per layer and iteration (tanh's input), as a layer outside the pipeline keeps it
    assert [s for s in shapes if s[:1] == (schedule.iterations,) and s[-1] == WIDE]
    schedule, shapes = residual_shapes("full")
    assert not [s for s in shapes if s[:1] == (schedule.iterations,) and s[-1] == WIDE]
