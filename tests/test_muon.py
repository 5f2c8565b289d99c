"""opt_type=muon: which weights are Muon's matrices, the update against optax's reference, the same losses on every
mesh as on one device, and a checkpoint of one optimizer refused by the other."""

import jax
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers as Dims

from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import optimizer, step as step_lib

MODEL = ("base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=8")
RTOL = 1e-5  # float32 on CPU: collectives change summation order only


@pytest.mark.parametrize("names,dims", [
    (("layers", "embed", "heads", "head_dim"), Dims((1,), (2, 3))),  # q, k, v: embed in, every head's out
    (("layers", "heads", "head_dim", "embed"), Dims((1, 2), (3,))),  # attention's out: the heads in
    (("layers", "experts", "embed", "moe_mlp"), Dims((2,), (3,))),  # each expert's matrix alone
    (("stage_layers", "embed", "mlp"), Dims((1,), (2,))),  # a pipeline's stack: each layer's alone
    (("layers", "experts", "moe_mlp", "embed"), Dims((2,), (3,))),
    (("layers", "kv_lora", "heads", "head_dim"), Dims((1,), (2, 3))),  # MLA's factored projections
    (("layers", "embed", "q_lora"), Dims((1,), (2,))),
    (("layers", "embed", None), Dims((1,), (2,))),  # the router
    (("mlp", "embed"), Dims((0,), (1,))),  # an unscanned matrix (MTP's projection)
    (("vocab", "embed"), None), (("embed", "vocab"), None),  # embedding and output head: AdamW's
    (("layers", "norm"), None), (("layers", "experts", "moe_mlp"), None), (("layers", "heads"), None),
])
def test_muon_takes_the_hidden_matrices_by_their_axis_names(names, dims):
    assert optimizer.muon_dimensions(names) == dims


def test_muon_update_is_optax_muons_for_the_matrices(tiny_config):
    """One step from the same gradients: the matrices' updates equal optax.contrib.muon's given the same
    matrices (its AdamW side is Nesterov's, ours plain AdamW: compared on the matrices only)."""
    c = tiny_config("opt_type=muon", "gradient_clipping_threshold=0", "muon_weight_decay=0", "muon_consistent_rms=0",
                    devices=jax.devices()[:1])
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, jax.devices()[:1]))
    params = trainer.init(jax.random.key(0)).params
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape, p.dtype), params)
    ours, _ = trainer.optimizer.update(grads, trainer.optimizer.init(params), params)
    dims = jax.tree.map(lambda s: optimizer.muon_dimensions(tuple(s)), trainer.param_logical_specs,
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    reference = optax.contrib.muon(optimizer.learning_rate_schedule(c), beta=c.muon_beta, eps=c.adam_eps,
                                   muon_weight_dimension_numbers=dims)
    theirs, _ = reference.update(grads, reference.init(params), params)
    matrices = 0
    for (path, a), b, d in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs),
                               jax.tree.leaves(dims, is_leaf=lambda x: x is None or isinstance(x, Dims))):
        if d is not None:
            matrices += 1
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    assert matrices == 7  # q, k, v, out, gate, up, down


STAGES = ("base_num_decoder_layers=4", *MODEL)  # 2 layers per stage


@pytest.mark.slow
@pytest.mark.parametrize("model,mesh,batch", [
    (MODEL, ("ici_fsdp_parallelism=8",), 1),
    (MODEL, ("ici_tensor_parallelism=2", "ici_fsdp_parallelism=4"), 1),
    (("model_name=mixtral-tiny", "max_target_length=32"), ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"), 1),
    (STAGES, ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_repeats=2",
              "num_pipeline_microbatches=4"), 2),
], ids=["fsdp8", "tensor2xfsdp4", "mixtral_expert4", "circular_stage2xfsdp4"])
def test_muon_meshes_match_one_device(train_tiny, reference_losses, model, mesh, batch):
    """Each matrix is orthogonalized whole however it is sharded (fsdp, tensor, each expert's on its own, a
    stage's layers in the circular schedule's order): the same 5 losses as one device."""
    single = reference_losses(*model, "opt_type=muon", f"per_device_batch_size={8 * batch}")
    losses = train_tiny(*model, "opt_type=muon", *mesh, f"per_device_batch_size={batch}")["losses"]
    assert len(losses) == len(single) == 5
    np.testing.assert_allclose(losses, single, rtol=RTOL)
    assert losses[-1] < losses[0]


def test_a_checkpoint_of_another_optimizer_is_refused_naming_both(train_tiny, tmp_path):
    """Resuming an adamw run with opt_type=muon is one line naming both; its parameters still load."""
    from maxtrain.checkpoint.describe import CheckpointError
    common = ("run_name=r", "steps=2", "enable_checkpointing=true", "checkpoint_period=2", "ici_fsdp_parallelism=1",
              "ici_data_parallelism=1")
    train_tiny(*common, n_devices=1)
    with pytest.raises(CheckpointError, match="adamw.*opt_type=muon") as e:
        train_tiny(*common[1:], "run_name=r", "steps=4", "opt_type=muon", n_devices=1)
    assert "\n" not in str(e.value)
    loaded = train_tiny("run_name=m", "steps=2", "opt_type=muon", f"load_parameters_path={tmp_path}/r/checkpoints/2",
                        n_devices=1)
    assert len(loaded["losses"]) == 2


def test_muon_keys_without_muon_are_said_and_an_unknown_optimizer_is_refused(tmp_path):
    import subprocess
    import sys
    from conftest import TINY
    from maxtrain.config import load as config_lib, schema
    c = config_lib.load([TINY, "muon_beta=0.9", "muon_consistent_rms=0"])
    assert schema.no_effect_warnings(c) == ["muon_beta: 0.9 has no effect: opt_type=adamw (it is Muon's)",
                                            "muon_consistent_rms: 0.0 has no effect: opt_type=adamw (it is Muon's)"]
    assert schema.no_effect_warnings(config_lib.load([TINY, "opt_type=muon", "muon_beta=0.9"])) == []
    proc = subprocess.run([sys.executable, "-m", "maxtrain.train", TINY, "opt_type=sgd",
                           f"base_output_directory={tmp_path}"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "config error: opt_type: 'sgd' is not one of adamw, muon"


@pytest.mark.slow
def test_a_muon_run_resumes_bit_for_bit(train_tiny):
    common = ("learning_rate_schedule_steps=4", "opt_type=muon", "enable_checkpointing=true", "checkpoint_period=2")
    straight = train_tiny("run_name=straight", "steps=4", *common, n_devices=2)["losses"]
    first = train_tiny("run_name=resumed", "steps=2", *common, n_devices=2)["losses"]
    then = train_tiny("run_name=resumed", "steps=4", *common, n_devices=2)["losses"]
    assert [*first, *then] == straight
