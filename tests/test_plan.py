"""The resolved config, the one logical -> mesh resolver and the execution plan (maxtrain.config.resolve,
maxtrain.parallel)."""

import dataclasses
import itertools
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY
from maxtrain.config import load as config_lib
from maxtrain.parallel.mesh import MESH_AXES
from maxtrain.models.args import ModelArgs
from maxtrain.models.decoder import Decoder
from maxtrain.parallel import rules
from maxtrain.parallel.plan import Plan
from maxtrain.config.resolve import DERIVED, Resolved, chosen_keys, resolve

BASE = str(config_lib.BASE_YML)


def flax_axes(rule_list, names):
    """nn.logical_to_mesh_axes, as lists of mesh axes per dimension."""
    spec = nn.logical_to_mesh_axes(names, rules.axis_rules({"logical_axis_rules": rule_list}))
    return [[] if a is None else [a] if isinstance(a, str) else list(a) for a in spec]


CUSTOM_RULES = [  # a later rule takes over where an earlier one's mesh axes are already used
    ["batch", ["data", "fsdp"]], ["experts", "fsdp"], ["embed", ["fsdp", "context"]], ["embed", "context"],
    ["mlp", "tensor"], ["moe_mlp", ["tensor", "data"]], ["moe_mlp", "expert"], ["heads", "tensor"], ["head_dim", None],
]


@pytest.mark.parametrize("rule_list", [config_lib.defaults()["logical_axis_rules"], CUSTOM_RULES])
def test_the_resolver_assigns_mesh_axes_as_flax_does(rule_list):
    names = ("batch", "length", "embed", "heads", "head_dim", "mlp", "experts", "moe_mlp", "vocab", "norm")
    for n in (1, 2, 3):
        for dims in itertools.permutations(names, n):
            assert rules.mesh_axes(rule_list, dims) == flax_axes(rule_list, dims), dims


def test_a_later_rule_applies_where_the_first_ones_axes_are_taken():
    """[experts, embed, moe_mlp] under CUSTOM_RULES: experts take fsdp, so embed falls to its second rule
    (context), where the first rule that names it would give fsdp again. The mesh checks ask this."""
    assert rules.mesh_axes(CUSTOM_RULES, ("experts", "embed", "moe_mlp")) == [["fsdp"], ["context"], ["tensor", "data"]]
    mesh_shape = {"data": 2, "fsdp": 4, "expert": 1, "context": 2, "tensor": 2}
    # even_axes: a size one axis does not divide is left out, later ones still split it
    assert rules.mesh_axes(CUSTOM_RULES, ("batch", "embed"), (6, 10), mesh_shape) == [["data"], ["context"]]
    assert rules.shards(CUSTOM_RULES, "batch", mesh_shape) == 8
    assert rules.shards(CUSTOM_RULES, "batch", mesh_shape, size=6) == 2


def test_a_resolved_config_declares_what_it_adds_and_leaves_nothing_auto():
    loaded = config_lib.load([TINY, "dtype=auto"])
    c = resolve(loaded, 8)
    assert isinstance(c, Resolved) and not isinstance(loaded, Resolved)
    assert set(c) - set(loaded) == set(DERIVED)
    # tiny.yml (its float32 aside) leaves them all auto
    assert all(loaded[k] == auto for k, auto in chosen_keys().items())
    assert all(c[k] != auto for k, auto in chosen_keys().items())
    assert c.mesh_shape == {**{a: 1 for a in MESH_AXES}, "fsdp": 8} and c.global_batch_size == 8
    assert isinstance(c.replace(scan_unroll=2), Resolved) and c.replace(scan_unroll=2).plan.scan_unroll == 2
    with pytest.raises(KeyError, match="not keys of the config: invented"):
        c.replace(invented=1)
    with pytest.raises(ValueError, match="no auto values: attention"):
        Resolved({**c, "attention": "auto"})
    with pytest.raises(ValueError, match="needs moe_chunk_size"):
        Resolved({k: v for k, v in c.items() if k != "moe_chunk_size"})


def test_resolve_takes_devices_or_their_count():
    loaded = config_lib.load([TINY])
    assert resolve(loaded, jax.devices()[:4]) == resolve(loaded, 4, 1, jax.devices()[0].platform)
    assert resolve(loaded, 4, platform="tpu").attention == "blockwise"  # 32 positions: not splash's blocks of 128


def test_the_plan_is_the_resolved_configs_choices():
    c = resolve(config_lib.load([TINY, "mlp_chunk_size=8", "ici_context_parallelism=2", "model_family=mixtral",
                                 "num_experts=4"]), 8)
    plan = ModelArgs.from_config(c).plan
    assert plan == c.plan == Plan(attention="blockwise", mlp_chunk=8, moe_chunk=8, moe_grouped_matmul="blocked",
                                  remat_policy="full", scan_unroll=1, context_load_balance=True)
    assert hash(plan) == hash(dataclasses.replace(plan))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.attention = "splash"


def test_a_loaded_config_builds_a_one_device_model():
    """No attention= or mlp_chunk_size= needed: the auto values take the reference choices, and the
    model's logits are the resolved model's with those choices."""
    loaded = config_lib.load([TINY])
    args = ModelArgs.from_config(loaded)
    assert args.plan == Plan(attention="dot_product", mlp_chunk=0, moe_chunk=0, moe_grouped_matmul="blocked",
                             remat_policy="full", scan_unroll=1, context_load_balance=True)
    tokens = jax.random.randint(jax.random.key(1), (2, loaded.max_target_length), 0, loaded.vocab_size)
    params = jax.jit(lambda k: nn.meta.unbox(Decoder(args).init(k, tokens)["params"]))(jax.random.key(0))
    resolved = resolve(config_lib.load([TINY, "attention=dot_product", "mlp_chunk_size=0", "scan_unroll=1"]), 1)
    same = Decoder(ModelArgs.from_config(resolved))
    np.testing.assert_array_equal(jax.jit(Decoder(args).apply)({"params": params}, tokens),
                                  jax.jit(same.apply)({"params": params}, tokens))


def test_the_model_names_no_mesh():
    """Model code speaks logical axes only: the mesh, shard_map and collectives are the plan's."""
    from pathlib import Path
    import maxtrain
    package = Path(maxtrain.__file__).parent
    for path in [*(package / "models").glob("*.py"), *(package / "ops").glob("*.py")]:
        name, text = path.name, path.read_text()
        found = re.findall(r"shard_map|get_abstract_mesh|length_shards|mesh_lib|all_to_all|all_gather|psum", text)
        assert found == [], (name, found)


def test_the_model_and_parallel_layers_load_without_the_config():
    """The layers below the config (docs/layout.md) work without it: importing them loads no config module."""
    code = ("import sys, maxtrain.parallel.mesh, maxtrain.parallel.plan, maxtrain.models.registry, maxtrain.data.pipeline; "
            "print(sorted(m for m in sys.modules if m.startswith('maxtrain.config')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]"]


def test_constrain_is_nothing_outside_a_mesh():
    x = jnp.ones((2, 3))
    assert rules.constrain(x, ("batch", "embed")) is x
