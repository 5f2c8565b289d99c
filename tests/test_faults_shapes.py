"""Uneven shapes are the framework's problem: a vocabulary is padded (and the padding masked), a width the
mesh does not divide is left unsharded on that axis with one note, and what cannot run is one config line.

Losses are compared in float32 (tiny.yml's dtype, float32 weights) at rtol 1e-5, as tests/test_parallel.py
does: a different mesh changes the order of summation only.
"""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from maxtrain.config import load as config_lib
from maxtrain import convert
from maxtrain.infer.sampling import Sampling
from maxtrain.training import loss as loss_lib
from maxtrain.parallel import mesh as mesh_lib, rules as rules_lib, rules
from maxtrain.models import args as args_lib, decoder as model_lib
from maxtrain.config.resolve import resolve
from maxtrain.training import step as step_lib
from maxtrain import train
from conftest import TINY, decode
from helpers import TOLERANCE, hf_logits, load_maxtrain, maxtrain_logits
from test_convert import random_hf_model
from helpers import main_in_process, one_line

RTOL = 1e-5
FLOAT32 = ("dtype=float32", "weight_dtype=float32")
SMOLLM_WIDTH = ("base_emb_dim=576", "base_num_query_heads=9", "base_num_kv_heads=3", "head_dim=64",
                "base_mlp_dim=1536")


def single_device(tmp_path, *overrides, steps=5):
    """The same run on one device with the same global batch of 8."""
    devices = jax.devices()[:1]
    c = train.load_config([TINY, *FLOAT32, *overrides, "per_device_batch_size=8", f"steps={steps}",
                           f"base_output_directory={tmp_path / 'one'}"], devices)
    return train.train(c, devices)


def notes(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("note:")]


# ---- the vocabulary: padded to a multiple of 128, whatever the mesh ---------------------------------

@pytest.mark.slow
def test_vocab_4001_on_tensor_2_trains_like_one_device_and_resumes_on_one_device(train_tiny, tmp_path, capsys):
    """An odd vocabulary (as Llama 2's 32001 with a pad token: 4001 trains the same paths at an eighth of the
    logits) padded to 4096, split over tensor=2."""
    vocab = ("vocab_size=4001", "enable_checkpointing=true")
    mesh = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    sharded = train_tiny(*FLOAT32, *vocab, *mesh)
    out = capsys.readouterr().out
    assert "maxtrain: 586,176 parameters" in out  # the true count: 4001 rows, not 4096
    assert notes(out) == []  # 4096 splits over tensor=2
    table = sharded["state"].params["embedding"]
    assert table.shape == (4096, 64) and table.sharding.shard_shape(table.shape) == (2048, 16)
    one = single_device(tmp_path, *FLOAT32, "vocab_size=4001")
    np.testing.assert_allclose(sharded["losses"], one["losses"], rtol=RTOL)
    assert len(one["losses"]) == 5 and np.all(np.isfinite(one["losses"]))
    # The checkpoint holds the padded table on any mesh: the tensor=2 run's resumes on 1 device (and gives the
    # step the mesh itself gives when it resumes).
    shutil.copytree(tmp_path / "tiny", tmp_path / "copy")
    resumed_one = train_tiny(*FLOAT32, *vocab, "steps=7", "per_device_batch_size=8", n_devices=1)
    resumed_mesh = train_tiny(*FLOAT32, *vocab, *mesh, "steps=7", "run_name=copy")
    assert "resumed from" in capsys.readouterr().out
    assert int(resumed_one["state"].step) == 7 and len(resumed_one["losses"]) == 2
    np.testing.assert_allclose(resumed_one["losses"], resumed_mesh["losses"], rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_padded_vocab_is_masked_out_of_the_loss_logits_and_sampling(tiny_config, tied):
    """Padding columns set far above every true logit: were they not masked, greedy decoding would pick
    one, and the loss would be about 50 nats higher."""
    c = tiny_config(*FLOAT32, "vocab_size=200", f"logits_via_embedding={str(tied).lower()}", devices=jax.devices()[:1])
    mesh = mesh_lib.make_mesh(c, jax.devices()[:1])
    trainer = step_lib.build(c, mesh)
    with mesh_lib.activate(mesh, trainer.rules):
        params = trainer.init(jax.random.key(0)).params
        assert params["embedding"].shape == (256, 64) and (tied or params["output"].shape == (64, 256))
        if tied:
            params["embedding"] = params["embedding"].at[200:].set(50.0)
        else:
            params["output"] = params["output"].at[:, 200:].set(50.0)
        tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 200)
        batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1), "weights": jnp.ones((2, 32))}
        logits = trainer.model.apply({"params": params}, tokens)
        assert logits.shape == (2, 32, 200)
        want = loss_lib.cross_entropy_sums_from_logits(logits, batch["targets"], batch["weights"])[0]
        loss_and_grads = jax.jit(jax.value_and_grad(lambda p: step_lib.loss_fn(p, trainer.model, batch), has_aux=True))
        (got, _), grads = loss_and_grads(params)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert got / 64 < np.log(200) + 2  # an untrained model's loss, not one with the padding in log Z
        padding_grad = grads["embedding"][200:] if tied else grads["output"][:, 200:]
        assert float(jnp.abs(padding_grad).max()) == 0.0
    greedy = decode(c, trainer, params, [[5, 17, 90]], 6)[0]
    sampled = decode(c, trainer, params, [[5, 17, 90]], 6, Sampling(temperature=1.0, seed=1))[0]
    assert max(greedy + sampled) < 200


def test_imported_vocab_32001_loads_on_tensor_2_and_exports_32001(tmp_path):
    model = random_hf_model("llama-gqa", vocab_size=32001)
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"))
    c, trainer, params = load_maxtrain(out / "maxtrain.yml", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    assert c.vocab_size == 32001 and params["output"].shape == (64, 32128)
    assert float(jnp.abs(params["output"][:, 32001:]).max()) == 0.0  # imported padding is zeros
    tokens = np.random.RandomState(0).randint(0, 32001, (8, 24))
    tokens[:, -1] = 32000  # the last true id
    ours = maxtrain_logits(trainer, params, tokens)
    assert ours.shape == (8, 24, 32001)
    assert np.abs(ours - hf_logits(model, tokens)).max() <= TOLERANCE
    convert.maxtrain_to_hf(str(out), str(tmp_path / "back"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert again.config.vocab_size == 32001
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert np.abs(hf_logits(again, tokens) - ours).max() <= TOLERANCE


# ---- widths: left unsharded on the axis that does not divide them, with one note ------------------

@pytest.mark.slow
@pytest.mark.parametrize("model, mesh, expected", [
    (("base_emb_dim=100",), ("ici_fsdp_parallelism=8",),
     ["note: embed (100) is not divisible by fsdp=8: left unsharded on that axis"]),
    (SMOLLM_WIDTH, ("ici_fsdp_parallelism=8",), []),
    (("base_mlp_dim=129",), ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
     ["note: mlp (129) is not divisible by tensor=2: left unsharded on that axis"]),
], ids=["embed100-fsdp8", "embed576-fsdp8", "mlp129-tensor2"])
def test_width_the_mesh_does_not_divide_trains_like_one_device(train_tiny, tmp_path, capsys, model, mesh, expected):
    sharded = train_tiny(*FLOAT32, *model, *mesh)
    assert notes(capsys.readouterr().out) == expected  # once, though every layer's weights have the width
    one = single_device(tmp_path, *model)
    assert len(sharded["losses"]) == len(one["losses"]) == 5
    np.testing.assert_allclose(sharded["losses"], one["losses"], rtol=RTOL)


@pytest.mark.slow
def test_the_planners_resolve_as_the_shardings_do(tiny_config):
    """The one resolver (the checks, platform defaults) and the parameters' real shardings agree, and the
    state's planned size is what a device holds."""
    c = tiny_config("base_emb_dim=100", "base_mlp_dim=129", "vocab_size=32001", "ici_fsdp_parallelism=4",
                    "ici_tensor_parallelism=2")
    trainer = step_lib.build(c, mesh_lib.make_mesh(c))
    specs = jax.tree.leaves(trainer.param_logical_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for spec, x in zip(specs, jax.tree.leaves(trainer.abstract_state.params)):
        planned = rules.mesh_axes(c.logical_axis_rules, tuple(spec), x.shape, c.mesh_shape)
        real = [[] if a is None else [a] if isinstance(a, str) else list(a) for a in x.sharding.spec]
        assert planned == real + [[]] * (len(planned) - len(real)), spec
    assert rules.mesh_axes(c.logical_axis_rules, ("mlp",), (129,), c.mesh_shape)[0] == []
    assert rules.mesh_axes(c.logical_axis_rules, ("vocab",), (32128,), c.mesh_shape)[0] == ["tensor"]
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        state = trainer.init(jax.random.key(0))
    held = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards
               if s.device == trainer.mesh.devices.flat[0])
    from maxtrain.observe import summary
    assert held == sum(summary.shard_bytes(x) for x in jax.tree.leaves(trainer.abstract_state))


def test_smollm2_width_on_fsdp_128_is_one_note():
    """SmolLM2-135M's width 576 on 128 devices, planned without them."""
    c = config_lib.load([str(config_lib.BASE_YML), "model_name=smollm2-135m", "per_device_batch_size=1"])
    c = resolve(c, 128)
    assert c.mesh_shape["fsdp"] == 128
    args = args_lib.ModelArgs.from_config(c)
    boxed = jax.eval_shape(model_lib.Decoder(args).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    import flax.linen as nn
    lines = rules_lib.uneven_notes(nn.get_partition_spec(boxed), nn.meta.unbox(boxed), rules_lib.axis_rules(c),
                                  c.mesh_shape)
    assert lines == ["note: embed (576) is not divisible by fsdp=128: left unsharded on that axis"]


# ---- what cannot be split at all: one config line naming both keys --------------------------------

@pytest.mark.parametrize("overrides, expected", [
    (("base_num_query_heads=9", "base_num_kv_heads=3", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=4"),
     "config error: base_num_query_heads: 9 is not divisible by ici_tensor_parallelism=2: the attention heads "
     "are split over the tensor axis (2)"),
    (("model_family=mixtral", "num_experts=4", "base_emb_dim=100", "ici_fsdp_parallelism=8"),
     "config error: base_emb_dim: 100 is not divisible by ici_fsdp_parallelism=8 (8 shards): the expert weights "
     "are split over fsdp x context, evenly or not at all"),
])
def test_what_cannot_split_unevenly_is_one_config_line(capsys, tmp_path, overrides, expected):
    code, err = main_in_process([TINY, f"base_output_directory={tmp_path}", *overrides], capsys)
    assert code == 2 and one_line(err) == expected
