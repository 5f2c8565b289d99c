"""Pipeline parallelism (maxtrain/parallel/pipeline.py): the schedule, its config checks, and training on
stage meshes equal to training on one device."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.config import load as config_lib
from maxtrain.config.keys import ConfigError
from maxtrain.parallel import mesh as mesh_lib, pipeline
from maxtrain.training import step as step_lib

from conftest import TINY, decode

# 4 layers (2 stages x 2 repeats, or 4 stages), 8 query and kv heads (tensor=2 divides them); a global batch
# of 16 in every run, so 4 micro-batches split over every stage's batch shards.
MODEL = ("base_num_decoder_layers=4", "base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=8")
# float32 on CPU: the pipeline changes where and in which order sums run, not what they are; stated 1e-5.
RTOL = 1e-5


def load(*overrides):
    return config_lib.load([TINY, *MODEL, *overrides])


# ---- the schedule


def test_bubble_and_iterations():
    assert pipeline.Schedule(4, 1, 4).bubble == pytest.approx(3 / 7)      # GPipe: (S-1) / (M+S-1)
    assert pipeline.Schedule(4, 2, 8).bubble == pytest.approx(3 / 19)     # circular: (S-1) / (R x M + S-1)
    assert pipeline.Schedule(2, 1, 8).iterations == 9
    assert not pipeline.Schedule().active and pipeline.Schedule(2, 1, 2).active
    assert pipeline.Schedule(2, 2, 4).describe() == "pipeline 2 stages (circular, 2 repeats) x 4 micro-batches, bubble 11.1%"


def test_storage_order_keeps_each_stage_chunks_together():
    # 8 layers, 2 stages, 2 repeats: chunks of 2; stage 0 runs layers 0-1 then 4-5, stage 1 layers 2-3 and 6-7
    order = pipeline.storage_order(8, 2, 2)
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert pipeline.storage_order(8, 2, 1).tolist() == list(range(8))  # GPipe: the model's own order
    schedule = pipeline.Schedule(2, 2, 2)
    tree = {"layers": {"w": jnp.arange(8.0)[:, None] * jnp.ones((8, 3))}, "embedding": jnp.arange(8.0)}
    stored = pipeline.to_storage_order(tree, {"layers"}, 8, schedule)
    assert stored["layers"]["w"][:, 0].tolist() == order.tolist()
    assert stored["embedding"].tolist() == list(range(8))  # not a stack: untouched
    back = pipeline.to_model_order(stored, {"layers"}, 8, schedule)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, back, tree))


# ---- config checks, each one line naming the key


@pytest.mark.parametrize("overrides,key,text", [
    (("ici_pipeline_parallelism=3",), "ici_pipeline_parallelism",
      "the pipeline's 4 layers (layers) do not split into 3 stages"),
    (("ici_pipeline_parallelism=2", "num_pipeline_microbatches=3"), "num_pipeline_microbatches",
      "3 is not a multiple of the 2 stages"),
    (("ici_pipeline_parallelism=2", "num_layers_per_pipeline_stage=3"), "num_layers_per_pipeline_stage",
      "3 does not divide each stage's 2 layers"),
    (("ici_pipeline_parallelism=2", "num_pipeline_repeats=2", "num_layers_per_pipeline_stage=2"),
     "num_pipeline_repeats", "2 x num_layers_per_pipeline_stage 2 != each stage's 2 layers"),
    (("ici_pipeline_parallelism=2", "scan_layers=false"), "scan_layers", "cannot run a pipeline"),
    (("ici_pipeline_parallelism=0",), "ici_pipeline_parallelism", "must be a positive integer"),
    (("dcn_pipeline_parallelism=-1",), "dcn_pipeline_parallelism", "must be a positive integer"),
    (("ici_pipeline_parallelism=2", "num_pipeline_microbatches=0"), "num_pipeline_microbatches",
      "must be positive or -1"),
])
def test_bad_pipeline_settings_are_refused_at_load(overrides, key, text):
    with pytest.raises(ConfigError) as e:
        load(*overrides)
    assert e.value.key == key and text in str(e.value) and "\n" not in str(e.value)


def test_the_schedule_follows_from_the_keys(tiny_config):
    def schedule(*overrides):
        c = tiny_config(*MODEL, "per_device_batch_size=2", *overrides)
        assert c.plan.schedule == pipeline.Schedule(c.mesh_shape["stage"], c.num_pipeline_repeats,
                                                    c.num_pipeline_microbatches)
        return c.plan.schedule
    # defaults: GPipe, one micro-batch per stage
    assert schedule("ici_pipeline_parallelism=2") == pipeline.Schedule(2, 1, 2)
    assert schedule("ici_pipeline_parallelism=2", "num_layers_per_pipeline_stage=1",
                    "num_pipeline_microbatches=4") == pipeline.Schedule(2, 2, 4)
    assert schedule("ici_pipeline_parallelism=4", "num_pipeline_repeats=1") == pipeline.Schedule(4, 1, 4)
    assert schedule() == pipeline.Schedule(1, 1, 1) and not schedule().active
    # the MoE stack (4 layers) is the pipeline's, the leading dense layer is not: 2 per stage, 2 repeats
    assert schedule("model_family=deepseek", "num_experts=4", "first_num_dense_layers=1", "base_num_decoder_layers=5",
                    "ici_pipeline_parallelism=2", "num_layers_per_pipeline_stage=1") == pipeline.Schedule(2, 2, 2)


def test_pipeline_keys_without_a_pipeline_warn():
    from maxtrain.config.schema import no_effect_warnings
    c = load("num_pipeline_microbatches=4", "num_pipeline_repeats=2")
    assert no_effect_warnings(c) == [
        "num_pipeline_microbatches: 4 has no effect: no pipeline (ici_pipeline_parallelism x dcn_pipeline_parallelism = 1)",
        "num_pipeline_repeats: 2 has no effect: no pipeline (ici_pipeline_parallelism x dcn_pipeline_parallelism = 1)"]
    assert no_effect_warnings(load("ici_pipeline_parallelism=2", "num_pipeline_repeats=2")) == []


def test_micro_batches_must_split_over_a_stage_batch_shards(tiny_config):
    with pytest.raises(ConfigError) as e:  # global batch 8 over 4 micro-batches: 2 rows, fsdp 4
        tiny_config(*MODEL, "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_microbatches=4")
    assert e.value.key == "num_pipeline_microbatches" and "a stage's 4 batch shards" in str(e.value)


def test_stacks_are_sharded_over_stage_and_the_rest_is_not(tiny_config):
    c = tiny_config(*MODEL, "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4")
    trainer = step_lib.build(c, mesh_lib.make_mesh(c))
    params = trainer.abstract_state.params
    wq = params["layers"]["attention"]["wq"]  # [layers 4, embed 64, heads 8, head_dim 8]
    assert wq.sharding.spec[0] == "stage" and wq.sharding.shard_shape(wq.shape)[:2] == (2, 16)
    assert "stage" not in str(params["embedding"].sharding.spec)  # the embedding is on every stage
    assert trainer.batch_sharding.spec[0][:1] == ("stage",)  # outside the pipeline the batch uses all devices
    assert trainer.notes[0] == ("pipeline placement: stage 0: layers 0-1; stage 1: layers 2-3 (layers); the embedding, "
                                "the final norm and the output layer run outside the pipeline on every stage, the "
                                "batch split over all devices")


@pytest.mark.slow
def test_the_first_line_and_dry_run_state_the_schedule(tmp_path):
    import subprocess, sys
    proc = subprocess.run([sys.executable, "-m", "maxtrain.train", TINY, *MODEL, "ici_pipeline_parallelism=2",
                           "ici_fsdp_parallelism=4", "per_device_batch_size=2", "num_pipeline_microbatches=4",
                           "num_pipeline_repeats=2", "dry_run=true", f"base_output_directory={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = next(line for line in proc.stdout.splitlines() if line.startswith("maxtrain: "))
    assert first.endswith("| pipeline 2 stages (circular, 2 repeats) x 4 micro-batches, bubble 11.1%")
    assert "pipeline placement: stage 0: layers 0, 2; stage 1: layers 1, 3 (layers);" in proc.stdout
    assert "train step memory per device:" in proc.stdout
    assert "Involuntary" not in proc.stderr  # no resharding the compiler could only do by replicating


# ---- training on stage meshes equals one device


@pytest.fixture
def single_device(reference_losses):
    return reference_losses(*MODEL, "per_device_batch_size=16")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [
    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"),
    ("ici_pipeline_parallelism=4", "ici_data_parallelism=2", "ici_fsdp_parallelism=1"),
    ("ici_pipeline_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"),
    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_repeats=2"),
], ids=["stage2xfsdp4", "stage4xdata2", "stage2xtensor2xfsdp2", "circular_stage2xfsdp4"])
def test_stage_meshes_match_single_device(train_tiny, single_device, mesh):
    result = train_tiny(*MODEL, *mesh, "per_device_batch_size=2", "num_pipeline_microbatches=4")
    assert len(result["losses"]) == 5
    np.testing.assert_allclose(result["losses"], single_device, rtol=RTOL)


def a_batch(c):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, c.vocab_size, (16, c.max_target_length + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "positions": np.broadcast_to(np.arange(c.max_target_length), (16, c.max_target_length)).astype(np.int32),
            "segment_ids": np.ones((16, c.max_target_length), np.int32),
            "weights": np.ones((16, c.max_target_length), np.float32)}


def one_step_gradients(c, devices):
    mesh = mesh_lib.make_mesh(c, devices)
    trainer = step_lib.build(c, mesh)
    batch = a_batch(c)
    with mesh_lib.activate(mesh, trainer.rules):
        state = trainer.init(jax.random.key(0))
        batch = jax.device_put(batch, trainer.batch_sharding)
        grad = jax.jit(jax.grad(lambda p, b: step_lib.loss_fn(p, trainer.model, b, scale=1.0 / 16)[0]))
        grads = grad(state.params, batch)
        return jax.device_get(trainer.to_saved(grads))  # the model's layer order


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(), ("num_pipeline_repeats=2",)], ids=["gpipe", "circular"])
def test_one_step_gradients_equal_single_device(tiny_config, mesh):
    one = tiny_config(*MODEL, "per_device_batch_size=16", devices=jax.devices()[:1])
    staged = tiny_config(*MODEL, "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "per_device_batch_size=2",
                         "num_pipeline_microbatches=4", *mesh)
    expected = one_step_gradients(one, jax.devices()[:1])
    got = one_step_gradients(staged, jax.devices())
    for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
        # float32 sums in another order: equal to 1e-5 of the largest entry
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * np.abs(e).max(), err_msg=jax.tree_util.keystr(path))


MOE = ("model_family=mixtral", "num_experts=8", "num_experts_per_tok=2", "norm_topk_prob=true",
       "load_balance_loss_weight=0.01")
# DeepSeek's layout: a leading dense layer (before the pipeline) and 4 MoE layers (the pipeline's)
DEEPSEEK = ("model_family=deepseek", "num_experts=8", "num_experts_per_tok=2", "shared_experts=1",
            "first_num_dense_layers=1",
            "routed_score_func=sigmoid", "norm_topk_prob=true", "routed_scaling_factor=2.5", "routed_bias=true",
            "base_moe_mlp_dim=32", "base_num_decoder_layers=5")


@pytest.mark.slow
@pytest.mark.parametrize("moe", [DEEPSEEK], ids=["deepseek"])  # routed experts as mixtral's, and more
def test_moe_on_stage2_x_expert4_matches_single_device(train_tiny, moe):
    """The routing statistics and auxiliary losses are per micro-batch, as under gradient accumulation:
    the reference is one device accumulating the same 4 micro-batches."""
    single = train_tiny(*MODEL, *moe, "run_name=single", "per_device_batch_size=16", "gradient_accumulation_steps=4",
                        n_devices=1)["losses"]
    staged = train_tiny(*MODEL, *moe, "run_name=staged", "ici_pipeline_parallelism=2", "ici_expert_parallelism=4",
                        "ici_fsdp_parallelism=1", "per_device_batch_size=2", "num_pipeline_microbatches=4")["losses"]
    np.testing.assert_allclose(staged, single, rtol=RTOL)


@pytest.mark.slow
def test_a_checkpoint_saved_on_2_stages_resumes_on_1_and_4(train_tiny, tmp_path):
    """Saved under the circular schedule (layers kept per stage in memory), the checkpoint holds the model's
    own layer order: one device and four stages resume it to the same next losses."""
    common = (*MODEL, "per_device_batch_size=2", "learning_rate_schedule_steps=6", "checkpoint_period=3")
    straight = train_tiny(*common, "run_name=straight", "steps=6", "enable_checkpointing=true")["losses"]
    saved = train_tiny(*common, "run_name=a", "steps=3", "enable_checkpointing=true", "ici_pipeline_parallelism=2",
                       "ici_fsdp_parallelism=4", "num_pipeline_repeats=2", "num_pipeline_microbatches=4")
    np.testing.assert_allclose(saved["losses"], straight[:3], rtol=RTOL)
    # the same arrays as the run without a pipeline saved (what export and generate read), layers in order
    import orbax.checkpoint as ocp
    pipelined, plain = (ocp.PyTreeCheckpointer().restore(tmp_path / run / "checkpoints" / "3" / "state")
                        for run in ("a", "straight"))
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(pipelined), jax.tree.leaves(plain)):
        # three Adam steps on float32 sums in another order: equal to 5e-4 of the largest entry (Adam divides
        # by sqrt(v): an entry whose gradient is near zero amplifies a rounding difference; 2e-4 seen on AMD EPYC)
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=5e-4 * np.abs(y).max(), err_msg=jax.tree_util.keystr(path))
    for i, mesh in enumerate([("ici_fsdp_parallelism=8",),
                              ("ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2", "num_pipeline_microbatches=4")]):
        shutil.copytree(tmp_path / "a", tmp_path / f"a{i}")  # the same run, resumed on another mesh
        resumed = train_tiny(*common, f"run_name=a{i}", "steps=6", "enable_checkpointing=true", *mesh)
        np.testing.assert_allclose(resumed["losses"], straight[3:], rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("settings,mesh", [
    # int8 scales activations by their absmax over each micro-batch: the reference accumulates the same 4
    (("quantization=int8",), ("ici_fsdp_parallelism=4",)),
    (("remat_policy=save_qkv_proj", "mlp_chunk_size=8", "loss_chunk_size=8"), ("ici_fsdp_parallelism=4",)),
    (("attention=dot_product",), ("ici_context_parallelism=2", "ici_fsdp_parallelism=2")),
], ids=["int8", "save_qkv_proj_chunks", "context2"])
def test_pipeline_with_other_features_matches_single_device(train_tiny, settings, mesh):
    quantized = "quantization=int8" in settings
    # int8 scales activations by their absmax over a micro-batch: the reference accumulates the same 4; and
    # a float32 rounding difference can flip an 8-bit value (as between any two meshes), and the flip grows
    # with the steps: 1.2e-3 by step 5 on an AMD EPYC, 4e-4 before; stated 2e-3
    accumulate = ("gradient_accumulation_steps=4",) if quantized else ()
    single = train_tiny(*MODEL, *settings, *accumulate, "run_name=single", "per_device_batch_size=16",
                        n_devices=1)["losses"]
    staged = train_tiny(*MODEL, *settings, *mesh, "run_name=staged", "ici_pipeline_parallelism=2",
                        "per_device_batch_size=2", "num_pipeline_microbatches=4", "num_pipeline_repeats=2")["losses"]
    np.testing.assert_allclose(staged, single, rtol=2e-3 if quantized else RTOL)


def test_pipelined_layers_run_their_matmuls_quantized(tiny_config):
    """The pipeline runs each layer as a module of its own: Qwix's rules still find its projections."""
    from test_quantization import lowered_dots
    c = tiny_config(*MODEL, "quantization=int8", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4",
                    "per_device_batch_size=2", "num_pipeline_microbatches=4")
    dots = lowered_dots(c)
    eight_bit = [shapes for types, shapes in dots if types == ("i8", "i8")]
    d, h, k, f = c.base_emb_dim, c.base_num_query_heads, c.head_dim, c.base_mlp_dim
    # per stage (the vmapped dimension, 2) the q projection [64, 8, 8] and the MLP's [64, 128], forward
    assert any({(2, 4, 32, d), (2, d, h, k)} <= s for s in eight_bit), eight_bit
    assert any((2, d, f) in s for s in eight_bit), eight_bit


@pytest.mark.slow
def test_generate_runs_a_pipelined_run_layers_in_order(tiny_config):
    """A pipelined run's parameters in the model's order (as its checkpoints hold them): maxtrain.generate
    under the run's config, stage axis and all, gives one device's greedy tokens."""

    def tokens(devices, *mesh):
        c = tiny_config(*MODEL, *mesh, devices=devices)
        trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
        with mesh_lib.activate(trainer.mesh, trainer.rules):
            params = trainer.to_saved(trainer.init(jax.random.key(0)).params)
            return decode(c, trainer, params, [[5, 6, 7, 8]], 6)[0]
    staged = tokens(jax.devices(), "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "per_device_batch_size=2",
                    "num_pipeline_microbatches=4", "num_pipeline_repeats=2")
    assert staged == tokens(jax.devices()[:1]) and len(staged) == 6


@pytest.mark.slow
def test_a_rollback_under_the_circular_schedule_equals_skipping_the_batches(train_tiny, monkeypatch, capsys):
    """The rollback restores the newest checkpoint (the model's layer order) into the circular schedule's
    order: from then on the run is the one that never saw the bad batches."""
    from test_faults import Poisoned, Skipping, stream
    args = (*MODEL, "per_device_batch_size=2", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4",
            "num_pipeline_microbatches=4", "num_pipeline_repeats=2", "enable_checkpointing=true", "steps=8",
            "checkpoint_period=3", "nan_policy=rollback", "learning_rate_schedule_steps=8")
    stream(monkeypatch, Poisoned, [4])
    rolled = train_tiny(*args, "run_name=rolled")
    assert "rollback: step 5 was not finite" in capsys.readouterr().out
    stream(monkeypatch, Skipping, [3, 4])
    reference = train_tiny(*args, "run_name=reference")
    assert len(rolled["losses"]) == 8
    np.testing.assert_allclose(rolled["losses"], reference["losses"], rtol=RTOL)


@pytest.mark.slow
def test_expert_load_is_reported_by_layer_under_the_circular_schedule(tiny_config):
    """The MoE layers' records come in the circular schedule's order; the metrics name them by layer."""
    def step_metrics(devices, *mesh):
        c = tiny_config(*MODEL, *MOE, *mesh, devices=devices)
        trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
        with mesh_lib.activate(trainer.mesh, trainer.rules):
            state = trainer.init(jax.random.key(0))
            return jax.device_get(trainer.train_step(state, jax.device_put(a_batch(c), trainer.batch_sharding))[1])
    one = step_metrics(jax.devices()[:1], "per_device_batch_size=16", "gradient_accumulation_steps=4")
    staged = step_metrics(jax.devices(), "ici_pipeline_parallelism=2", "ici_expert_parallelism=4",
                          "ici_fsdp_parallelism=1", "per_device_batch_size=2", "num_pipeline_microbatches=4",
                          "num_pipeline_repeats=2")
    assert staged["expert_load"].shape == (4, 8)
    np.testing.assert_allclose(staged["expert_load"], one["expert_load"], atol=1e-6)
    np.testing.assert_allclose(staged["loss"], one["loss"], rtol=RTOL)


def test_quantization_rules_find_the_pipelined_mlp_in_training_and_in_generate():
    import re
    from maxtrain.models import decoder_spec
    paths = decoder_spec.quantization_paths(load("ici_pipeline_parallelism=2", "quantization=int8"))
    for path in ("mlp", "layers/mlp"):  # rooted at the layer in the pipeline; the stack's path in generate
        assert re.fullmatch(paths["mlp"], path) and re.fullmatch(paths["attention"], path.replace("mlp", "attention"))
    assert not re.fullmatch(paths["mlp"], "layers/attention")


def test_rules_that_leave_the_stages_holding_every_layer_are_refused(tiny_config):
    import yaml
    rules = [r for r in config_lib.defaults()["logical_axis_rules"] if r[0] != "stage_layers"]
    with pytest.raises(ConfigError) as e:
        tiny_config(*MODEL, "ici_pipeline_parallelism=2", "per_device_batch_size=2",
                    f"logical_axis_rules={yaml.safe_dump(rules, default_flow_style=True).strip()}")
    assert e.value.key == "logical_axis_rules" and 'needs the rule ["stage_layers", "stage"]' in str(e.value)
