"""Where the optimizer state lives and in what: Adam's second moment in bfloat16 (nu_dtype), the state and the
weights in host memory (optimizer_memory_host_offload, parameter_memory_host_offload), and the bytes per parameter
a device holds, as dry_run and maxtrain.compile report them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import TINY
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib

OFFLOAD = ("optimizer_memory_host_offload=true", "parameter_memory_host_offload=true")


def test_the_second_moment_in_bfloat16(tiny_config):
    """nu_dtype=bfloat16: the state holds Adam's second moment in bfloat16 (12 bytes per parameter with mu_dtype
    bfloat16), and one step moves the weights as float32 moments do, to bfloat16's precision."""
    states = {}
    for nu in ("float32", "bfloat16"):
        c = tiny_config(f"nu_dtype={nu}", devices=jax.devices()[:1])
        trainer = step_lib.build(c, mesh_lib.make_mesh(c, jax.devices()[:1]))
        state = trainer.init(jax.random.key(0))
        grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape, p.dtype), state.params)
        update = jax.jit(trainer.optimizer.update)
        for _ in range(2):
            updates, opt_state = update(grads, state.opt_state, state.params)
            state = state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state)
        states[nu] = state
    is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
    nus = [x for s in jax.tree.leaves(states["bfloat16"].opt_state, is_leaf=is_adam) if is_adam(s)
           for x in jax.tree.leaves(s.nu)]
    assert nus and {x.dtype for x in nus} == {jnp.dtype(jnp.bfloat16)}
    for a, b in zip(jax.tree.leaves(states["bfloat16"].params), jax.tree.leaves(states["float32"].params)):
        np.testing.assert_allclose(a, b, atol=3e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["persistent", "local"])
def test_host_offload_trains_checkpoints_and_resumes_as_without(train_tiny, tmp_path, capsys, tier):
    """On CPU the host's memory is the device's (the first lines say so), but the path is TPU's and GPU's: the
    state's home is pinned_host, the step streams it through the device, saves read it there, a restore puts it
    back there. Losses are those of the run without offload, across resumes that turn it off and on again."""
    common = ("learning_rate_schedule_steps=4", "ici_fsdp_parallelism=2", "per_device_batch_size=2")
    plain = train_tiny("steps=4", *common, "run_name=plain", n_devices=2)["losses"]
    saved = (*common, "run_name=off", "enable_checkpointing=true", "checkpoint_period=1") if tier == "persistent" \
        else (*common, "run_name=off", "enable_checkpointing=true", "checkpoint_period=100",
              f"local_checkpoint_directory={tmp_path}/local", "local_checkpoint_period=1")
    first = train_tiny(*OFFLOAD, "steps=2", *saved, n_devices=2)
    assert "no effect on CPU (its device memory is the host's)" in capsys.readouterr().out
    state = first["state"]
    assert {x.sharding.memory_kind for x in jax.tree.leaves((state.params, state.opt_state))} == {"pinned_host"}
    without = train_tiny("steps=3", *saved, n_devices=2)["losses"]  # saved with offload, resumed without
    again = train_tiny(*OFFLOAD, "steps=4", *saved, n_devices=2)["losses"]  # and back
    assert capsys.readouterr().out.count(f"of the {tier} tier" if tier == "local" else "resumed from") == 2
    np.testing.assert_allclose([*first["losses"], *without, *again], plain, rtol=1e-6)


def test_dry_run_says_where_the_state_lives_and_its_bytes_per_parameter(tmp_path, capsys):
    from maxtrain import train
    lines = {}
    for name, overrides in (("adamw", ()), ("narrow", ("nu_dtype=bfloat16", "mu_dtype=bfloat16")),
                            ("offload", ("optimizer_memory_host_offload=true",)), ("both", OFFLOAD)):
        c = train.load_config([TINY, "dry_run=true", f"base_output_directory={tmp_path}",
                               *overrides], jax.devices()[:1])
        train.train(c, jax.devices()[:1])
        lines[name] = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("train state per device"))
    assert "optimizer state" in lines["adamw"] and "in device" in lines["adamw"]
    assert "floor 16.0 (weights 4.0 + gradients 4.0 + optimizer 8.0), plan" in lines["adamw"]
    assert "floor 12.0 (weights 4.0 + gradients 4.0 + optimizer 4.0)" in lines["narrow"]
    assert "in pinned_host" in lines["offload"] and "optimizer 0.0)" in lines["offload"]
    # offloaded weights still come in for the forward and backward passes: the floor counts them
    assert "device: weights 0.000 GiB in pinned_host | optimizer" in lines["both"]
    assert "floor 8.0 (weights 4.0 + gradients 4.0 + optimizer 0.0)" in lines["both"]


@pytest.mark.slow
def test_a_non_finite_step_leaves_the_offloaded_state_as_it_was(train_tiny, monkeypatch):
    """The streamed update keeps each part as it was when the step is not finite (a select per part): the same
    losses as the run without offload, before and after a poisoned batch."""
    from test_faults import Poisoned, stream
    stream(monkeypatch, Poisoned, [2])
    runs = [train_tiny("steps=5", f"run_name=r{i}", *overrides)["losses"]
            for i, overrides in enumerate(((), OFFLOAD, OFFLOAD[1:]))]  # the weights alone offloaded too
    for run in runs[1:]:
        assert np.isnan(runs[0][2]) and np.isnan(run[2])
        np.testing.assert_allclose(np.delete(run, 2), np.delete(runs[0], 2), rtol=1e-6)
