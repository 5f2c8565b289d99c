"""What a pipelined stack keeps for its backward pass: what the layers' remat policy keeps, never more."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from maxtrain.models import remat
from maxtrain.parallel import pipeline

D, MLP = 8, 32


def _layer(w, x, positions, segment_ids):
    h = checkpoint_name(jnp.tanh(x @ w["up"]), remat.MLP_OUT)  # a tagged activation, [b, L, MLP]
    return x + h @ w["down"], {}


def _saved(policy_name, capsys) -> list[str]:
    """The residuals the pipelined stack's gradient keeps, as JAX prints them (dtype[shape])."""
    layers = 4
    schedule = pipeline.Schedule(stages=2, repeats=1, microbatches=4)
    params = {"up": jnp.full((layers, D, MLP), 0.01), "down": jnp.full((layers, MLP, D), 0.01)}
    x = jnp.ones((8, 16, D))
    positions = segments = jnp.ones((8, 16), jnp.int32)

    def loss(params, x):
        out, _ = pipeline.run(_layer, params, x, positions, segments, schedule, remat.POLICIES[policy_name])
        return jnp.sum(out)
    capsys.readouterr()
    with jax.set_mesh(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",))):
        jax.ad_checkpoint.print_saved_residuals(loss, params, x)
    return re.findall(r"\w+\[[\d,]*\]", capsys.readouterr().out)


def _mlp_activations(saved):
    # [iterations, stages, layers per stage, micro-batch rows, L, MLP]: the tagged activation of every layer
    # at every iteration (the weights [.., D, MLP] end in MLP too, but have no length dimension of 16)
    return [s for s in saved if s.endswith(f",16,{MLP}]")]


def test_remat_full_keeps_no_tagged_activation(capsys):
    saved = _saved("full", capsys)
    assert saved  # the iteration's carries at least
    assert _mlp_activations(saved) == []


def test_a_policy_that_saves_the_tag_keeps_it(capsys):
    assert _mlp_activations(_saved("save_dot_except_mlpwi", capsys)) == ["f32[5,2,2,2,16,32]"]
