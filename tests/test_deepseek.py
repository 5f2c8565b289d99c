"""DeepSeek-V3/V2 (maxtrain/models/deepseek.py, mla.py, mtp.py): multi-head latent attention through every
kernel against a dense reference; group-limited routing against HF's routers; HF import/export with
logits parity against transformers' DeepseekV3ForCausalLM and DeepseekV2ForCausalLM (q_lora_rank > 0 and
0, scanned and unrolled), greedy ids through the latent KV cache; multi-token prediction (its shifted
targets, its loss, its depths through an HF round trip); one-line refusals; the same losses on every mesh."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file as load_torch
from transformers import (AutoModelForCausalLM, DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                          DeepseekV3ForCausalLM)

from maxtrain import convert
from maxtrain.config import load as config_lib
from maxtrain.models import hf as hf_format, moe, mtp
from maxtrain.ops import attention
from maxtrain.ops.attention import Variant
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.runtime.errors import ConvertError
from maxtrain.training import step as step_lib

from conftest import decode
from test_attention_variants import reference
from helpers import TOLERANCE, hf_logits, maxtrain_logits, random_hf
from test_convert_moe import load_maxtrain
from test_decode import step_logits_against_full_forward
from test_metrics import xla_and_formula_flops

# ---------------------------------------------------------------------------------------------
# Latent attention's shapes through the kernels: values narrower than queries and keys


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["dot_product", "blockwise", "jax_nn", "splash"])
def test_every_kernel_takes_values_of_another_width(kernel):
    """q/k heads of 24, values of 12 (MLA's P + R and J), packed documents, 320 positions (blockwise: two
    blocks): outputs and gradients equal the dense reference's."""
    ks = jax.random.split(jax.random.key(0), 4)
    length = 256 if kernel == "splash" else 320
    q, k = (jax.random.normal(key, (2, length, 4, 24)) for key in ks[:2])
    v = jax.random.normal(ks[2], (2, length, 4, 12))
    segments = jnp.asarray(np.repeat([[1], [1]], length, axis=1) + (np.arange(length) >= 100)[None] * [[1], [0]])
    cotangent = jax.random.normal(ks[3], (2, length, 4, 12))
    variant = Variant(scale=0.3)
    if kernel == "splash":
        from maxtrain.parallel import context
        fn = lambda q, k, v: context.splash(q, k, v, segments, variant=variant)  # noqa: E731
    else:
        fn = lambda q, k, v: attention.KERNELS[kernel](q, k, v, segments, variant)  # noqa: E731
    ours, ours_vjp = jax.vjp(jax.jit(fn), q, k, v)
    theirs, theirs_vjp = jax.vjp(lambda q, k, v: reference(q, k, v, segments, scale=0.3), q, k, v)
    assert ours.shape == (2, length, 4, 12)
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-5)
    for name, a, b in zip("qkv", ours_vjp(cotangent), theirs_vjp(cotangent)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=f"d{name}")


def test_group_limited_routing_picks_as_hf_routers():
    """DeepSeek-V3's groups score by their best two (choice scores, bias included), V2's by their best one;
    experts come only from the best topk_group groups."""
    rng = np.random.default_rng(0)
    scores = rng.random((64, 16)).astype(np.float32)
    for best_two in (True, False):
        limited = np.asarray(moe.limit_to_groups(jnp.asarray(scores), 4, 2, best_two))
        for row, out in zip(scores, limited):
            grouped = row.reshape(4, 4)
            group_score = np.sort(grouped, -1)[:, -2:].sum(-1) if best_two else grouped.max(-1)
            keep = np.zeros(4, bool)
            keep[np.argsort(-group_score)[:2]] = True
            np.testing.assert_array_equal(out, np.where(np.repeat(keep, 4), row, -np.inf))


# ---------------------------------------------------------------------------------------------
# HF import/export against transformers

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
             v_head_dim=12, qk_nope_head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256,
             rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "beta_fast": 8.0,
                              "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7,
                              "original_max_position_embeddings": 64})
VARIANTS = {
    # V3: sigmoid scores with the balancing bias, the best 2 of 4 groups, renormalised, scaled
    "v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    "v3-no-q-lora": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(n_group=2, topk_group=1, q_lora_rank=None)),
    "v3-halves": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(n_group=1, topk_group=1, rope_interleave=False)),
    # V2: softmax scores, group-limited greedy, not renormalised
    "v2": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(n_group=4, topk_group=2, topk_method="group_limited_greedy",
                                                         q_lora_rank=None, routed_scaling_factor=1.5)),
}
TOKENS = np.random.RandomState(0).randint(0, SMALL["vocab_size"], (4, 24))


def random_deepseek(kind="v3", **overrides):
    """Every tensor random (norms about 1, the rest about 0.1), the balancing bias too."""
    config_cls, model_cls, extra = VARIANTS[kind]
    model = random_hf(model_cls, config_cls(**{**SMALL, **extra, **overrides}, attn_implementation="eager"))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """imported(kind, scan) -> (transformers model, maxtrain.yml of its import), each made once."""
    made = {}

    def get(kind, scan=True):
        if (kind, scan) not in made:
            tmp = tmp_path_factory.mktemp(f"{kind}-{scan}")
            model = random_deepseek(kind)
            model.save_pretrained(tmp / "hf")
            out = convert.hf_to_maxtrain(str(tmp / "hf"), str(tmp / "mt"), overrides=(f"scan_layers={scan}",))
            made[kind, scan] = (model, out / "maxtrain.yml")
        return made[kind, scan]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("kind,scan,kernel", [("v3", True, "dot_product"), ("v3", False, "blockwise"),
                                              ("v3-no-q-lora", True, "blockwise"), ("v3-no-q-lora", False, "jax_nn"),
                                              ("v3-halves", True, "dot_product"), ("v2", False, "dot_product")])
def test_imported_model_gives_hf_logits(imported, kind, scan, kernel):
    model, yml = imported(kind, scan)
    c, trainer, params = load_maxtrain(yml, f"attention={kernel}")
    assert c.attention_type == "mla" and c.rope_type == "yarn" and c.rope_yarn_mscale_all_dim == 0.7
    assert (c.q_lora_rank, c.first_num_dense_layers, c.routed_score_func) == (
        0 if kind in ("v3-no-q-lora", "v2") else 24, 1, "softmax" if kind == "v2" else "sigmoid")
    ref = hf_logits(model, TOKENS)
    assert np.abs(ref).max() > 1.0
    assert np.abs(maxtrain_logits(trainer, params, TOKENS) - ref).max() <= TOLERANCE


@pytest.mark.slow
def test_the_groups_the_bias_the_rope_order_and_mscale_each_matter(imported):
    """Parity is no accident: without the groups, the balancing bias, the interleaved order undone, or
    mscale_all_dim's factor on the scores, the logits move."""
    import dataclasses
    from maxtrain.models.decoder import Decoder
    model, yml = imported("v3")
    _, trainer, params = load_maxtrain(yml)
    ref, args = hf_logits(model, TOKENS), trainer.model.args
    zero_bias = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if "router_bias" in jax.tree_util.keystr(path) else x, params)
    rotated = jax.tree_util.tree_map_with_path(  # the rotary rows left interleaved
        lambda path, x: jnp.concatenate([x[..., :-8], x[..., -8:].reshape(*x.shape[:-1], 2, 4).swapaxes(-1, -2)
                                         .reshape(*x.shape[:-1], 8)], -1)
        if jax.tree_util.keystr(path).endswith("['wkv_a']") else x, params)
    ungrouped = dataclasses.replace(args, moe=dataclasses.replace(args.moe, groups=0))
    unscaled = dataclasses.replace(args, attention=dataclasses.replace(
        args.attention, scale=args.attention.qk_head_dim ** -0.5))
    for changed_args, changed_params in ((ungrouped, params), (args, zero_bias), (args, rotated), (unscaled, params)):
        changed = dataclasses.replace(trainer, model=Decoder(changed_args))
        assert np.abs(maxtrain_logits(changed, changed_params, TOKENS) - ref).max() > 1e-2


@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_export_reloads_in_transformers_with_identical_weights(tmp_path, imported, kind):
    model, yml = imported(kind, True)
    convert.maxtrain_to_hf(str(yml.parent), str(tmp_path / "back"))
    original, exported = load_torch(yml.parent.parent / "hf" / "model.safetensors"), load_torch(
        tmp_path / "back" / "model.safetensors")
    assert set(exported) == set(original)
    for name, x in original.items():
        assert torch.equal(exported[name], x), name
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    reloaded = AutoModelForCausalLM.from_pretrained(yml.parent.parent / "hf").eval()
    assert type(again) is type(model)
    np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(reloaded, TOKENS))


def test_export_of_halves_writes_the_interleaved_layout_with_the_same_logits(tmp_path, imported):
    """A checkpoint whose rotary rows are halves (rope_interleave=false) goes out in DeepSeek's interleaved
    layout, rope_interleave=true: the same model."""
    model, yml = imported("v3-halves", True)
    convert.maxtrain_to_hf(str(yml.parent), str(tmp_path / "back"))
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_interleave"] is True
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert np.abs(hf_logits(again, TOKENS) - hf_logits(model, TOKENS)).max() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["v3", "v3-no-q-lora"])
def test_greedy_ids_through_the_latent_cache_equal_transformers(imported, kind):
    model, yml = imported(kind, True)
    c, trainer, params = load_maxtrain(yml)
    prompts = [[5, 17, 90, 3, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    ours = decode(c, trainer, params, prompts, 32)
    for prompt, ids in zip(prompts, ours):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
        assert len(ids) == 32 and ids == ref


@pytest.mark.slow
def test_each_latent_decode_step_gives_the_full_forward_logits(imported):
    _, yml = imported("v3", True)
    c, trainer, params = load_maxtrain(yml, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    assert step_logits_against_full_forward(c, trainer, params, [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]], 12) <= 1e-4


def test_every_latent_projection_splits_over_fsdp(tiny_config):
    """No MLA weight is whole on every device under fsdp: the latents' axes take fsdp where embed does not."""
    c = tiny_config("model_name=deepseek-v3-tiny", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, jax.devices()))
    attention_specs = {name: tuple(s.spec) for name, s in
                       trainer.state_shardings.params["moe_layers"]["attention"].items() if name.startswith("w")}
    split = ("fsdp", "context", "expert")  # the weights' axes beside tensor (context and expert are 1 here)
    assert attention_specs == {"wq_a": (None, split, None), "wq_b": (None, split, "tensor", None),
                               "wkv_a": (None, split, None), "wkv_b": (None, split, "tensor", None),
                               "wo": (None, "tensor", None, split)}
    assert tuple(trainer.state_shardings.params["mtp_1"]["projection"].spec) == ("tensor", split)


def test_the_latent_cache_costs_the_latent_and_the_rotary_key(tiny_config):
    from maxtrain.infer.kv_cache import bytes_per_slot, layout
    c = tiny_config("model_name=deepseek-v3-tiny", "dtype=float32", devices=jax.devices()[:1])
    args = step_lib.registry.spec_for(c).args(c)
    assert layout(args) == (1, c.qk_rope_head_dim, c.kv_lora_rank)
    assert bytes_per_slot(args) == (16 + 32) * 4  # against 2 x 4 heads x (48 + 32) x 4 expanded


def test_forward_flops_of_latent_attention_match_xla_cost_analysis(tiny_config):
    """The FLOPs formula (MFU's numerator) with latent attention: its five projections and its scores over
    q/k heads of P + R and values of J; within 5% of XLA's count (which adds the elementwise work)."""
    c = tiny_config("scan_layers=false", "base_emb_dim=256", "base_mlp_dim=1024", "vocab_size=1024",
                    "max_target_length=128", "remat_policy=none", "model_family=deepseek", "attention_type=mla",
                    "base_num_kv_heads=4", "q_lora_rank=96", "kv_lora_rank=64", "qk_nope_head_dim=64",
                        "qk_rope_head_dim=32", "v_head_dim=48",
                    devices=jax.devices()[:1])
    xla, ours = xla_and_formula_flops(c)
    assert abs(xla - ours) / ours < 0.05, (xla, ours)


def test_unsupported_configs_are_refused_in_one_line():
    cases = [
        ({"model_type": "deepseek_v3", **SMALL, "attention_bias": True},
         "config.json: attention_bias=true is not supported (maxtrain's latent attention has no projection biases)"),
        ({"model_type": "deepseek_v2", **SMALL, "topk_method": "noaux_tc"},
         "config.json: topk_method='noaux_tc' is not supported (DeepSeek-V2: greedy or group_limited_greedy)"),
        ({"model_type": "deepseek_v3", **SMALL, "n_group": 3, "topk_group": 1},
         "config.json: n_group=3, topk_group=1 do not split 8 experts"),
        ({"model_type": "deepseek_v3", **SMALL, "first_k_dense_replace": 3},
         "config.json: first_k_dense_replace=3 leaves no MoE layer of 3"),
    ]
    for hf, message in cases:
        with pytest.raises(ConvertError) as e:
            hf_format.model_keys_from_hf(hf)
        assert str(e.value) == message


@pytest.mark.parametrize("change,message", [
    (("routed_bias=false",), "routed_bias=False: HF's DeepSeek-V3 (sigmoid scores) has the balancing bias"),
    (("routed_score_func=softmax", "routed_bias=false"), "norm_topk_prob=True: HF's DeepSeek-V2 (softmax scores) has "
                                                         "neither the balancing bias nor renormalised weights"),
    (("attention_type=gqa", "base_num_kv_heads=2", "head_dim=32"),
     "shared_experts=1: neither Mixtral nor Qwen3-MoE has this (HF export needs 0), and DeepSeek's HF models have "
     "latent attention (attention_type=mla)"),
])
def test_export_refuses_what_deepseek_cannot_express(change, message):
    c = config_lib.load([str(config_lib.BASE_YML), "model_name=deepseek-v3-tiny", *change])
    with pytest.raises(ConvertError) as e:
        hf_format.hf_kind(c)
    assert str(e.value) == message


@pytest.mark.parametrize("change,message", [
    (("sliding_window_size=8",), "sliding_window_size: 8 is not supported with attention_type=mla (needs 0)"),
    (("base_num_kv_heads=2",), "base_num_kv_heads: 2: with attention_type=mla every query head has its own keys and "
                               "values (set it to base_num_query_heads=4)"),
    (("qk_rope_head_dim=15",), "qk_rope_head_dim: 15 must be even (RoPE rotates pairs)"),
    (("kv_lora_rank=0",), "kv_lora_rank: must be a positive integer with attention_type=mla, got 0"),
    (("n_routing_groups=3",), "n_routing_groups: 3 must be positive and divide num_experts=8"),
    (("topk_routing_group=-1",), "topk_routing_group: n_routing_groups and topk_routing_group are set together "
                                 "(both -1: no groups)"),
    (("topk_routing_group=1", "num_experts_per_tok=3"), "num_experts_per_tok: 3 exceeds the 1 groups' 2 experts a "
                                                        "token may pick from"),
    (("mtp_num_layers=-1",), "mtp_num_layers: must be in [0, max_target_length=128), got -1"),
    (("mtp_num_layers=63",), "mtp_num_layers: 63 is out of range: at most 8 (DeepSeek-V3 trains with 1; each depth is a layer of "
                             "its own, unrolled in the step: compile time and memory grow with it)"),
    (("ici_pipeline_parallelism=2",), "mtp_num_layers: multi-token prediction cannot be pipelined yet "
                                      "(ici/dcn_pipeline_parallelism=1)"),
    (("rope_yarn_mscale=-1",), "rope_yarn_mscale: must be >= 0 (0 = not set), got -1.0"),
])
def test_config_refusals_name_the_key(change, message):
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.load([str(config_lib.BASE_YML), "model_name=deepseek-v3-tiny", *change])
    assert str(e.value) == message


# ---------------------------------------------------------------------------------------------
# Multi-token prediction


def test_each_depth_takes_the_tokens_k_ahead_within_the_document():
    inputs = jnp.asarray([[10, 11, 12, 13, 14, 15]])
    batch = {"inputs": inputs, "targets": inputs + 1, "weights": jnp.asarray([[1., 1, 1, 1, 1, 0]]),
             "segment_ids": jnp.asarray([[1, 1, 1, 2, 2, 2]]), "positions": jnp.asarray([[0, 1, 2, 0, 1, 2]])}
    out = mtp.shifted(batch, 2)
    np.testing.assert_array_equal(out["mtp_inputs_1"], [[11, 12, 13, 14, 15, 0]])
    np.testing.assert_array_equal(out["mtp_targets_1"], [[12, 13, 14, 15, 16, 0]])
    np.testing.assert_array_equal(out["mtp_weights_1"], [[1, 1, 0, 1, 0, 0]])  # 13 is the next document's; 16 padding
    np.testing.assert_array_equal(out["mtp_inputs_2"], [[12, 13, 14, 15, 0, 0]])
    np.testing.assert_array_equal(out["mtp_weights_2"], [[1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(mtp.depth_tokens(out, 2)[1], out["mtp_inputs_2"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["model_name=deepseek-v3-tiny", "use_qk_norm=false"])  # and base.yml's Llama
def test_the_loss_adds_each_depths_cross_entropy_scaled(tiny_config, family):
    """loss_fn's total: the main sum plus mtp_loss_scaling_factor x the depths' sums averaged over depths;
    the depths' own cross-entropy is in aux; eval (no factor) runs no depth. Any family may have depths."""
    devices = jax.devices()[:1]
    c = tiny_config(family, "mtp_num_layers=2", "dtype=float32", devices=devices)
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
    from maxtrain.data import pipeline as data
    batch = mtp.shifted(data.synthetic_batch(0, seed=0, batch=2, length=c.max_target_length, vocab=c.vocab_size), 2)
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        params = trainer.init(jax.random.key(0)).params
        loss = jax.jit(lambda p, b, **kw: step_lib.loss_fn(p, trainer.model, b, **kw), static_argnames="mtp_factor")
        plain, plain_aux = loss(params, batch)
        total, aux = loss(params, batch, mtp_factor=0.3)
        zero, _ = loss(params, batch, mtp_factor=0.0)
    assert "mtp_loss_sum" not in plain_aux and float(plain) == pytest.approx(float(zero), rel=1e-6)
    assert float(aux["mtp_tokens"]) == float(jnp.sum(batch["mtp_weights_1"]) + jnp.sum(batch["mtp_weights_2"]))
    assert float(total) == pytest.approx(float(plain) + 0.3 / 2 * float(aux["mtp_loss_sum"]), rel=1e-5)
    mean = float(aux["mtp_loss_sum"] / aux["mtp_tokens"])
    assert np.log(c.vocab_size) - 1 < mean < np.log(c.vocab_size) + 1  # an untrained depth: about uniform


@pytest.mark.slow
def test_mtp_depths_go_out_in_deepseeks_layout_and_come_back(tmp_path, tiny_config):
    """A model with a depth, exported: transformers loads it (ignoring the depth) with the model's logits;
    the files hold the depth as layer L (enorm, hnorm, eh_proj, shared_head, its layer, copies of the
    embedding and the output); imported again, every parameter, the depth's included, is as it was."""
    from maxtrain.checkpoint import loading as ckpt_loading
    devices = jax.devices()[:1]
    c = tiny_config("model_name=deepseek-v3-tiny", "dtype=float32",
                    "vocab_size=96", f"base_output_directory={tmp_path}",
                    devices=devices)
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        params = trainer.init(jax.random.key(1)).params
    first = ckpt_loading.save_parameters(tmp_path / "mt", params, c) or tmp_path / "mt"
    convert.maxtrain_to_hf(str(first), str(tmp_path / "hf"))
    files = load_torch(tmp_path / "hf" / "model.safetensors")
    layer = f"model.layers.{c.base_num_decoder_layers}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
                 "shared_head.head.weight", "self_attn.kv_b_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert layer + name in files, name
    assert torch.equal(files[layer + "embed_tokens.weight"], files["model.embed_tokens.weight"])
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 1 and written["model_type"] == "deepseek_v3"
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = TOKENS % 96
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        ours = np.asarray(jax.jit(trainer.model.apply)({"params": params}, jnp.asarray(tokens)))
    assert np.abs(ours - hf_logits(hf_model, tokens)).max() <= TOLERANCE
    back = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "again"))
    c2, _, params2 = load_maxtrain(back / "maxtrain.yml", n_devices=1)
    assert c2.mtp_num_layers == 1
    flat, again = jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(params2)
    differ = [jax.tree_util.keystr(path) for (path, a), b in zip(flat, again, strict=True) if not np.array_equal(a, b)]
    assert differ == ["['embedding']", "['output']"]  # their padding rows (past the vocabulary) only: zeros now
    for name in ("embedding", "output"):
        kept = (slice(0, 96),) if name == "embedding" else (slice(None), slice(0, 96))
        np.testing.assert_array_equal(params[name][kept], params2[name][kept])


# ---------------------------------------------------------------------------------------------
# Training on every mesh

# expert, context and tensor in one mesh: each was a run of 40 to 150 s, and a fault of any shows here
MESH_RUNS = {"expert2xcontext2xtensor2": ("ici_expert_parallelism=2", "ici_context_parallelism=2",
                                          "ici_tensor_parallelism=2", "ici_fsdp_parallelism=1")}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESH_RUNS))
def test_the_same_losses_on_every_mesh_with_mtp(train_tiny, reference_losses, mesh):
    """5 steps, float32, the tiny DeepSeek-V3 with its multi-token prediction depth, the same global batch of 8:
    one device, and expert 2 x context 2 x tensor 2 (zigzag order: each depth's targets are shifted in
    sequence order first)."""
    common = ("model_name=deepseek-v3-tiny", "dtype=float32", "vocab_size=256", "steps=5", "log_period=1")
    one = reference_losses(*common, "per_device_batch_size=8")
    assert len(one) == 5 and one[-1] < one[0]
    losses = train_tiny(*common, *MESH_RUNS[mesh], f"run_name={mesh}")["losses"]
    np.testing.assert_allclose(losses, one, rtol=2e-5, err_msg=mesh)
