"""Train step: gradient accumulation, masked loss, optimizer pieces."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxtrain.data import pipeline as data
from maxtrain.training import loss as loss_lib
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib
from maxtrain.models import registry
from maxtrain.training.optimizer import learning_rate_schedule


def one_step(c, devices):
    mesh = mesh_lib.make_mesh(c, devices)
    trainer = step_lib.build(c, mesh)
    with mesh_lib.activate(mesh, trainer.rules):
        state = trainer.init(jax.random.key(0))
        batch = next(data.make_iterator(c, trainer.batch_sharding))
        state, metrics = trainer.train_step(state, batch)
    return jax.device_get(state.params), jax.device_get(metrics)


@pytest.mark.slow
def test_gradient_accumulation_equals_large_batch(tiny_config):
    devices = jax.devices()
    # Adam's first step is ~lr*sign(g), which turns rounding noise on near-zero gradients into
    # lr-sized differences; a large eps makes the update linear in g, so params compare gradients.
    base = ("per_device_batch_size=2", "adam_eps=1.0")  # global batch 16 over 8 fsdp shards
    ref_params, ref_m = one_step(tiny_config(*base), devices)
    acc_params, acc_m = one_step(tiny_config(*base, "gradient_accumulation_steps=2"), devices)
    np.testing.assert_allclose(acc_m["loss"], ref_m["loss"], rtol=1e-6)
    np.testing.assert_allclose(acc_m["grad_norm"], ref_m["grad_norm"], rtol=1e-5)
    assert acc_m["tokens"] == ref_m["tokens"] == 16 * 32
    for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(acc_params)):
        np.testing.assert_allclose(a, b, atol=1e-8)


@pytest.mark.slow
def test_gradient_accumulation_single_device(tiny_config):
    devices = jax.devices()[:1]
    ref_params, _ = one_step(tiny_config("per_device_batch_size=8", "adam_eps=1.0", devices=devices), devices)
    acc_params, _ = one_step(tiny_config("per_device_batch_size=8", "adam_eps=1.0",
                                         "gradient_accumulation_steps=4", devices=devices), devices)
    for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(acc_params)):
        np.testing.assert_allclose(a, b, atol=1e-8)


@pytest.mark.slow
def test_bfloat16_weights_with_gradient_accumulation(tiny_config):
    # The output matrix's gradient must come back in its own dtype, or the accumulator's type changes.
    devices = jax.devices()[:1]
    c = tiny_config("per_device_batch_size=4", "weight_dtype=bfloat16", "gradient_accumulation_steps=2",
                    devices=devices)
    params, metrics = one_step(c, devices)
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert np.isfinite(metrics["loss"]) and metrics["tokens"] == 4 * 32


@pytest.mark.slow
def test_the_step_donates_the_state(tiny_config):
    # The new state reuses the old state's buffers: a step holds one copy of params and moments, not two.
    devices = jax.devices()[:2]
    c = tiny_config(devices=devices)
    mesh = mesh_lib.make_mesh(c, devices)
    trainer = step_lib.build(c, mesh)
    with mesh_lib.activate(mesh, trainer.rules):
        state = trainer.init(jax.random.key(0))
        batch = next(data.make_iterator(c, trainer.batch_sharding))
        new_state, _ = trainer.compile_train_step()(state, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(state))
    assert not any(x.is_deleted() for x in jax.tree.leaves(new_state)) and not batch["inputs"].is_deleted()


def one_device_setup(tiny_config, masked_from: int, overrides=()):
    """Tiny trainer and params on one device, and a batch of 2 whose targets from `masked_from` on
    have weight 0."""
    c = tiny_config(*overrides, devices=jax.devices()[:1])
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, jax.devices()[:1]))
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        params = trainer.init(jax.random.key(0)).params
    batch = data.synthetic_batch(0, seed=0, batch=2, length=32, vocab=256)
    batch["weights"] = jnp.asarray(batch["weights"]).at[:, masked_from:].set(0.0)
    return trainer, params, batch


@pytest.mark.slow
def test_masked_targets_do_not_count(tiny_config):
    trainer, params, batch = one_device_setup(tiny_config, masked_from=16)
    scrambled = dict(batch, targets=jnp.asarray(batch["targets"]).at[:, 16:].set(7))
    loss = lambda b: step_lib.loss_fn(params, trainer.model, b)  # noqa: E731
    (total_a, aux_a), (total_b, _) = loss(batch), loss(scrambled)
    assert float(aux_a["tokens"]) == 2 * 16
    np.testing.assert_allclose(total_a, total_b, rtol=1e-6)
    # z-loss adds a positive term
    z, _ = step_lib.loss_fn(params, trainer.model, batch, z_loss_multiplier=1e-2)
    assert float(z) > float(total_a)


def test_weight_decay_skips_norm_scales():
    params = {"layers": {"attention_norm": {"scale": jnp.ones(3)}, "mlp": {"wo": jnp.ones((3, 3))}},
              "embedding": jnp.ones((4, 3))}
    mask = registry.family("llama").decayed(params)
    assert mask == {"layers": {"attention_norm": {"scale": False}, "mlp": {"wo": True}}, "embedding": True}


def test_schedule_warmup_then_cosine_to_final_fraction(tiny_config):
    c = tiny_config("steps=100", "warmup_steps_fraction=0.1", "learning_rate=1.0",
                    "cosine_learning_rate_final_fraction=0.1")
    lr = learning_rate_schedule(c)
    assert float(lr(0)) == 0.0
    np.testing.assert_allclose(float(lr(5)), 0.5, rtol=1e-6)
    np.testing.assert_allclose(float(lr(10)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(lr(100)), 0.1, rtol=1e-5)
    const = learning_rate_schedule(tiny_config("lr_schedule_type=constant", "warmup_steps_fraction=0"))
    assert float(const(0)) == float(const(50)) == 3e-3
    lin = learning_rate_schedule(tiny_config("steps=10", "lr_schedule_type=linear", "learning_rate=1.0",
                                             "warmup_steps_fraction=0"))
    np.testing.assert_allclose([float(lin(0)), float(lin(10))], [1.0, 0.1], rtol=1e-6)


def test_clipping_is_in_the_chain(tiny_config):
    tx = step_lib.make_optimizer(tiny_config("gradient_clipping_threshold=0.5"))
    params = {"w": jnp.ones((2, 2))}
    state = tx.init(params)
    updates, _ = tx.update({"w": jnp.full((2, 2), 100.0)}, state, params)
    assert isinstance(updates["w"], jax.Array)
    assert optax.tree.norm(updates) < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("tied", ["false", "true"])
def test_cross_entropy_backward_equals_autodiff(tiny_config, tied):
    """The hand-written backward, all positions at once and 8 at a time, against autodiff through the
    whole [B,L,V] logits, z-loss included."""
    trainer, params, batch = one_device_setup(tiny_config, masked_from=20, overrides=(f"logits_via_embedding={tied}",))

    def reference(p):
        logits_BxLxV = trainer.model.apply({"params": p}, batch["inputs"])
        ce, z = loss_lib.cross_entropy_sums_from_logits(logits_BxLxV, batch["targets"], batch["weights"])
        return ce + 1e-3 * z

    ref, ref_grads = jax.jit(jax.value_and_grad(reference))(params)
    for chunk in (0, 8):
        f = lambda p: step_lib.loss_fn(p, trainer.model, batch, 1e-3, chunk)  # noqa: E731
        (total, aux), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
        np.testing.assert_allclose(total, ref, rtol=1e-6)
        assert float(aux["tokens"]) == 40
        # Summed (not mean) gradients, accumulated in another order: float32 rounding, rtol 1e-5.
        for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def grads_on(tiny_config, devices, *overrides, dtype="float32"):
    """(loss, float32 gradients) of one synthetic batch of 8 x 32, params from seed 0."""
    c = tiny_config(f"dtype={dtype}", "z_loss_multiplier=1e-3", *overrides, devices=devices)
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
    batch = data.synthetic_batch(0, seed=0, batch=8, length=32, vocab=256)
    batch["weights"] = jnp.asarray(batch["weights"]).at[:, 24:].set(0.0)
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        params = trainer.init(jax.random.key(0)).params
        batch = jax.device_put(batch, trainer.batch_sharding)
        f = lambda p: step_lib.loss_fn(p, trainer.model, batch, c.z_loss_multiplier, c.loss_chunk_size)[0]  # noqa: E731
        loss, grads = jax.jit(jax.value_and_grad(f))(params)
    return float(loss), jax.device_get(grads)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "minimal", "none"])
def test_memory_levers_give_the_same_loss_and_gradients(tiny_config, policy):
    """loss_chunk_size (hand-written backward, output gradient reduce-scattered chunk by chunk) and
    mlp_chunk_size, sharded over fsdp x tensor, against the plain path on one device."""
    plain = grads_on(tiny_config, jax.devices()[:1], f"remat_policy={policy}")
    mesh = ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
    chunked = grads_on(tiny_config, jax.devices()[:4], f"remat_policy={policy}", *mesh,
                       "loss_chunk_size=8", "mlp_chunk_size=8")
    np.testing.assert_allclose(chunked[0], plain[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(chunked[1])):  # summed: up to ~10
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(a).max()))


@pytest.mark.slow
def test_memory_levers_in_bfloat16(tiny_config):
    """The same in bfloat16 compute: float32 gradients of float32 weights, equal to bf16 rounding."""
    devices = jax.devices()[:1]
    plain = grads_on(tiny_config, devices, dtype="bfloat16")
    chunked = grads_on(tiny_config, devices, "loss_chunk_size=8", "mlp_chunk_size=16", dtype="bfloat16")
    np.testing.assert_allclose(chunked[0], plain[0], rtol=1e-2)
    for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(chunked[1])):
        assert b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=0.1, atol=0.02 * np.abs(a).max())


def test_loss_chunk_size_must_divide_length(tiny_config):
    import pytest
    from maxtrain.config.keys import ConfigError
    with pytest.raises(ConfigError) as e:
        tiny_config("loss_chunk_size=5")
    assert e.value.key == "loss_chunk_size"


@pytest.mark.slow
def test_logits_in_compute_dtype_gives_the_same_loss(tiny_config):
    """logits_dot_in_fp32=false rounds bf16 logits once before the float32 loss: the same loss to bf16
    precision, full and chunked; with float32 compute nothing changes at all."""
    devices = jax.devices()[:1]
    batch = data.synthetic_batch(0, seed=0, batch=2, length=32, vocab=256)

    def loss(*overrides):
        c = tiny_config(*overrides, devices=devices)
        trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
        with mesh_lib.activate(trainer.mesh, trainer.rules):
            params = trainer.init(jax.random.key(0)).params
            total, aux = jax.jit(lambda p: step_lib.loss_fn(p, trainer.model, batch, 0.0, c.loss_chunk_size))(params)
        return float(aux["loss_sum"] / aux["tokens"])

    for chunk in ("loss_chunk_size=0", "loss_chunk_size=8"):
        bf16 = [loss("dtype=bfloat16", f"logits_dot_in_fp32={v}", chunk) for v in ("true", "false")]
        np.testing.assert_allclose(bf16[1], bf16[0], rtol=2e-3)
        assert bf16[0] != bf16[1]  # the setting does take effect
        f32 = [loss("dtype=float32", f"logits_dot_in_fp32={v}", chunk) for v in ("true", "false")]
        assert f32[0] == f32[1]


@pytest.mark.slow
def test_cheap_compiles_give_the_same_results(tiny_config, monkeypatch):
    """On CPU init and the step compile at XLA's level 1, for startup time (unless XLA_FLAGS sets a level, as
    the tests' does). Init must give the same bits as XLA's defaults; the step may differ in the last float32
    bits (LLVM orders some sums differently), no more."""
    monkeypatch.setenv("XLA_FLAGS", re.sub(r"--xla_backend_optimization_level=\d+", "", os.environ["XLA_FLAGS"]))
    c = tiny_config(devices=jax.devices()[:1])
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, jax.devices()[:1]))
    defaults = {"xla_backend_optimization_level": 3}
    rng = jax.random.key(3)
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        default = jax.device_get(trainer.init.lower(rng).compile(defaults)(rng))
        fast = jax.device_get(trainer.init(rng))
        for a, b in zip(jax.tree.leaves(default), jax.tree.leaves(fast)):
            np.testing.assert_array_equal(a, b)
        batch = next(data.make_iterator(c, trainer.batch_sharding))
        default_step = trainer.train_step.lower(trainer.init(rng), batch).compile(defaults)
        after_default = jax.device_get(default_step(trainer.init(rng), batch))  # (the step donates its state)
        after_fast = jax.device_get(trainer.train_step(trainer.init(rng), batch))
    for a, b in zip(jax.tree.leaves(after_default), jax.tree.leaves(after_fast)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)


def test_wsd_holds_the_peak_then_decays_the_last_fraction(tiny_config):
    c = tiny_config("steps=100", "lr_schedule_type=wsd", "warmup_steps_fraction=0.1", "learning_rate=1.0",
                    "wsd_decay_steps_fraction=0.2", "cosine_learning_rate_final_fraction=0.1")
    lr = learning_rate_schedule(c)
    np.testing.assert_allclose([float(lr(s)) for s in (0, 5, 10, 50, 80, 90, 100)],
                               [0.0, 0.5, 1.0, 1.0, 1.0, 0.55, 0.1], rtol=1e-6)
    cos = learning_rate_schedule(c.replace(wsd_decay_style="cosine"))
    np.testing.assert_allclose([float(cos(80)), float(cos(90)), float(cos(100))], [1.0, 0.55, 0.1], rtol=1e-5)
    longer = learning_rate_schedule(c.replace(learning_rate_schedule_steps=200))
    assert [float(longer(s)) for s in range(20, 160)] == [1.0] * 140  # extended in its stable phase: no jump
    from maxtrain.training.optimizer import describe_schedule
    assert describe_schedule(c) == "lr wsd 1 (warmup 10, stable to step 80, linear decay to 0.1x at 100)"
    # an absolute warmup stays what it was when the schedule is extended; the fraction's grows with it
    fixed = c.replace(warmup_steps=10, learning_rate_schedule_steps=200)
    assert float(learning_rate_schedule(fixed)(5)) == pytest.approx(0.5)
    assert float(learning_rate_schedule(c.replace(learning_rate_schedule_steps=200))(5)) == pytest.approx(0.25)


@pytest.mark.parametrize("args, key", [(("warmup_steps=8",), "warmup_steps"),
                                       (("warmup_steps_fraction=0.8",), "warmup_steps_fraction")])
def test_a_wsd_warmup_that_runs_into_the_decay_is_refused(tiny_config, args, key):
    """It warmed up to step 9 and ended at 0.82x of the peak while the first line said "stable to step 5"."""
    from maxtrain.config.keys import ConfigError
    c = tiny_config("steps=10", "lr_schedule_type=wsd", "wsd_decay_steps_fraction=0.5", *args)
    with pytest.raises(ConfigError) as e:
        learning_rate_schedule(c)
    assert str(e.value) == (f"{key}: a warmup of 8 steps runs into wsd's decay over the last 5 (wsd_decay_steps_"
                            "fraction=0.5 of learning_rate_schedule_steps=10): warmup + decay must be at most 10")
    fits = c.replace(**{key: {"warmup_steps": 5, "warmup_steps_fraction": 0.5}[key]})
    assert float(learning_rate_schedule(fits)(5)) == pytest.approx(c.learning_rate)  # peak, then the decay


@pytest.mark.slow
def test_a_wsd_run_extended_in_its_stable_phase_goes_on_at_the_same_rate(train_tiny, tmp_path, capsys):
    """Stopped at step 60 of a 100-step schedule, resumed with a 200-step one: the same learning rate at steps
    60 and 61; under cosine the same extension is said to re-stretch the curve, with the jump."""
    def lrs(name):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/learning_rate"] for r in rows if "train/learning_rate" in r}
    for kind in ("wsd", "cosine"):
        args = (f"run_name={kind}", f"lr_schedule_type={kind}", "wsd_decay_steps_fraction=0.2",
                "warmup_steps_fraction=0.1", "enable_checkpointing=true", "checkpoint_period=1000")
        train_tiny(*args, "steps=60", "learning_rate_schedule_steps=100", n_devices=1)
        capsys.readouterr()
        train_tiny(*args, "steps=62", "learning_rate_schedule_steps=200", n_devices=1)
        out, got = capsys.readouterr().out, lrs(kind)
        if kind == "wsd":
            assert got[60] == got[61] == got[62] == pytest.approx(3e-3)
            assert "the learning rate goes on at 3.000e-03 from step 60" in out
        else:
            assert got[61] > got[60] * 1.1
            assert re.search(r"note: learning_rate_schedule_steps is 200 where the last start's was 100: the "
                             r"cosine schedule is re-stretched, the learning rate at step 60 goes from \S+ to \S+ "
                             r"\(lr_schedule_type=wsd extends", out), out


@pytest.mark.slow
def test_a_wsd_run_extended_after_its_decay_goes_back_to_its_last_stable_step(train_tiny, tmp_path, capsys):
    """The steps after the peak decayed toward the old end: an extension resumes from the checkpoint saved at
    the old schedule's last stable step (always saved, and kept by retention), the decayed ones kept aside, and
    trains on at the peak."""
    args = ("run_name=ext", "lr_schedule_type=wsd", "wsd_decay_steps_fraction=0.2", "warmup_steps_fraction=0",
            "enable_checkpointing=true", "checkpoint_period=3", "max_num_checkpoints_to_keep=2")
    train_tiny(*args, "steps=20", n_devices=1)
    checkpoints = tmp_path / "ext" / "checkpoints"
    assert sorted((p.name for p in checkpoints.iterdir() if p.name.isdigit()), key=int) == ["16", "18", "20"]
    capsys.readouterr()
    train_tiny(*args, "steps=22", "learning_rate_schedule_steps=40", n_devices=1)
    out = capsys.readouterr().out
    assert ("a wsd run extended (learning_rate_schedule_steps 20 -> 40): resuming from step 16 (kept aside: "
            "18.decayed, 20.decayed)") in out and f"resumed from {checkpoints}/16" in out
    rows = [json.loads(x) for x in (tmp_path / "ext" / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["train/learning_rate"] for r in rows if "train/learning_rate" in r}
    assert lrs[17] == lrs[22] == pytest.approx(3e-3)  # at the peak again, where the 20-step run had decayed
    assert (checkpoints / "18.decayed").is_dir() and (checkpoints / "20.decayed").is_dir()
