"""Quantized training through Qwix: which matmuls run on 8-bit operands, how close they stay to float,
and that it trains, sharded, with checkpoints that load either way."""

import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib
from conftest import TINY

EIGHT_BIT = {"i8", "f8E4M3FN", "f8E5M2"}


def lowered_dots(c):
    """(operand dtypes, the shapes involved) of every dot in the lowered train step."""
    mesh = mesh_lib.make_mesh(c)
    trainer = step_lib.build(c, mesh)
    with mesh_lib.activate(mesh, trainer.rules):
        text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).as_text()
    dots = []
    for line in text.splitlines():
        m = re.search(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)", line)
        if m:
            parsed = [re.fullmatch(r"tensor<((?:\d+x)*)(\w+)>", t).groups() for t in m.groups()]
            shapes = {tuple(int(d) for d in dims.split("x")[:-1]) for dims, _ in parsed}
            dots.append(((parsed[0][1], parsed[1][1]), shapes))
    return dots


def by_weight(c, dots):
    """The dots grouped by the weight they multiply (forward) or differentiate (backward): a dot whose
    operand or result has a weight's shape; `other` for attention's scores and values."""
    d, h, n, k, f, v = (c.base_emb_dim, c.base_num_query_heads, c.base_num_kv_heads, c.head_dim,
                        c.base_mlp_dim, c.vocab_size)
    weights = {"attention": {(d, h, k), (d, n, k)}, "mlp": {(d, f)}, "output": {(d, v)}}
    weights = {name: {tuple(sorted(w)) for w in ws} for name, ws in weights.items()}  # in any axis order
    groups = {name: [] for name in (*weights, "other")}
    for types, shapes in dots:
        shapes = {tuple(sorted(s)) for s in shapes}
        name = next((name for name, ws in weights.items() if ws & shapes), "other")
        groups[name].append(types)
    return groups


@pytest.mark.parametrize("mode, targets, scan", [("int8", "attention,mlp", True), ("fp8_full", "mlp", False),
                                                ("fp8", "attention,mlp", True)])
def test_quantized_matmuls_are_where_the_rules_say(tiny_config, mode, targets, scan):
    c = tiny_config(f"quantization={mode}", f"quantization_targets={targets}", f"scan_layers={scan}",
                    "dtype=bfloat16", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    groups = by_weight(c, lowered_dots(c))
    forward = {"int8": "i8", "fp8": "f8E4M3FN", "fp8_full": "f8E4M3FN"}[mode]
    for name, types in groups.items():
        assert types, name
        quantized = [t for t in types if set(t) & EIGHT_BIT]
        if name in targets.split(","):
            assert len(quantized) == len(types) or mode == "fp8", (name, types)  # fp8: backward in bf16
            assert (forward, forward) in quantized, (name, types)
            if mode == "fp8_full":
                assert any("f8E5M2" in t for t in quantized), (name, types)  # the gradients in e5m2
            if mode == "fp8":
                assert not any("f8E5M2" in t for t in types) and len(quantized) < len(types)
        else:  # the output layer, attention's scores and values, and targets not named
            assert not quantized, (name, types)


@pytest.mark.slow
def test_an_moe_model_quantizes_its_attention_not_its_experts(tiny_config):
    c = tiny_config("model_family=mixtral", "num_experts=4", "num_experts_per_tok=2", "quantization=int8",
                    "dtype=bfloat16",
                    "ici_expert_parallelism=4", "ici_fsdp_parallelism=2")
    groups = by_weight(c, lowered_dots(c))
    assert groups["attention"] and all(set(t) <= {"i8"} for t in groups["attention"])
    assert groups["other"] and not any(set(t) & EIGHT_BIT for t in groups["other"])  # router, experts, scores


def test_an_moe_models_shared_experts_and_dense_layers_are_its_mlp_target(tiny_config):
    c = tiny_config("model_family=deepseek", "num_experts=4", "num_experts_per_tok=2", "shared_experts=1",
                    "first_num_dense_layers=1",
                    "quantization=int8", "quantization_targets=mlp", "dtype=bfloat16")
    groups = by_weight(c, lowered_dots(c))  # the shared expert's width (1 x base_mlp_dim) is the dense MLP's
    assert groups["mlp"] and all(set(t) <= {"i8"} for t in groups["mlp"])
    assert not any(set(t) & EIGHT_BIT for t in groups["attention"] + groups["other"])


def test_quantization_targets_are_not_checked_while_quantization_is_off(tiny_config):
    assert tiny_config("quantization_targets=anything").quantization == ""


def test_the_float_step_has_no_8_bit_matmul(tiny_config):
    dots = lowered_dots(tiny_config("dtype=bfloat16"))
    assert dots and not any(set(types) & EIGHT_BIT for types, _ in dots)


@pytest.mark.slow
@pytest.mark.parametrize("mode, tolerance", [("int8", 0.04), ("fp8", 0.12)])
def test_a_quantized_layer_stays_close_to_the_float_one(tiny_config, mode, tolerance):
    """One layer's logits in float32, RMS error over the logits' RMS: int8 (per-channel scales) within 4%,
    e4m3 (3 mantissa bits: 3% per rounded operand) within 12%. (Measured: 2.3% and 8.8%.)"""
    plain = tiny_config("base_num_decoder_layers=1", devices=jax.devices()[:1])
    quantized = tiny_config("base_num_decoder_layers=1", f"quantization={mode}", devices=jax.devices()[:1])
    tokens = np.random.default_rng(0).integers(0, plain.vocab_size, (2, plain.max_target_length))
    one = jax.devices()[:1]
    float_model, quantized_model = (step_lib.build(c, mesh_lib.make_mesh(c, one)).model for c in (plain, quantized))
    params = float_model.init(jax.random.key(0), tokens)
    want = np.asarray(float_model.apply(params, tokens))
    got = np.asarray(quantized_model.apply(params, tokens))
    error = np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2))
    assert 0 < error < tolerance, error


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("quantization=int8",), ("quantization=fp8_full", "remat_policy=minimal", "gradient_accumulation_steps=2")])
def test_quantized_training_follows_the_float_run_on_fsdp_x_tensor(train_tiny, overrides):
    mesh = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "dtype=bfloat16", "steps=8")
    plain = train_tiny(*mesh, "run_name=plain", *overrides[1:])["losses"]
    quantized = train_tiny(*mesh, "run_name=quantized", *overrides)["losses"]
    assert quantized[-1] < quantized[0] - 0.2  # it learns
    np.testing.assert_allclose(quantized, plain, rtol=0.03)


@pytest.mark.slow
def test_a_checkpoint_trained_quantized_resumes_unquantized(train_tiny):
    common = ("ici_fsdp_parallelism=8", "enable_checkpointing=true", "checkpoint_period=3", "run_name=q")
    first = train_tiny(*common, "quantization=int8", "steps=3")
    resumed = train_tiny(*common, "steps=5")  # the same run, quantization off: resumes at step 3
    back = train_tiny(*common, "quantization=fp8_full", "steps=7")  # and on again, from step 5
    assert [len(r["losses"]) for r in (first, resumed, back)] == [3, 2, 2]
    assert np.all(np.isfinite(resumed["losses"] + back["losses"]))


@pytest.mark.parametrize("overrides, message", [
    ("quantization=int4", "quantization: 'int4' is not one of \"\", int8, fp8, fp8_full"),
    ("quantization=int8 quantization_targets=output", "quantization_targets: the output layer stays in the compute"),
    ("quantization=int8 quantization_targets=mlp,ffn", "quantization_targets: 'ffn' is not one of attention, mlp"),
    ("quantization=int8 attention=jax_nn", "attention: jax_nn cannot run beside quantized attention projections"),
    ("quantization=int8 quantization_targets=mlp model_family=mixtral num_experts=4",
     "quantization_targets: an MoE model's only MLPs"),
    ("quantization=int8 quantization_targets=mlp,mlp", "quantization_targets: 'mlp,mlp' names a target twice"),
])
def test_bad_quantization_keys_are_one_line(overrides, message):
    proc = subprocess.run([sys.executable, "-m", "maxtrain.train", TINY, *overrides.split(), "steps=1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert message in proc.stderr, proc.stderr
