"""Model families (maxtrain.models.registry): which family a config is, each family's parameter count
against its built model and transformers' model, and the trained/decayed masks in a real train step
(DeepSeek's balancing bias moves by its own rule alone, whatever the weight decay)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.data import pipeline as data
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.models import moe, hf, registry
from maxtrain.runtime.errors import ConvertError
from maxtrain.training import step as step_lib

MOE = ("num_experts=4", "num_experts_per_tok=2", "norm_topk_prob=true", "base_moe_mlp_dim=32")
DEEPSEEK_TINY = ("model_family=deepseek", "num_experts=8", "num_experts_per_tok=2", "shared_experts=1",
                 "first_num_dense_layers=1", "routed_score_func=sigmoid", "norm_topk_prob=true",
                     "routed_scaling_factor=2.5",
                 "routed_bias=true", "base_moe_mlp_dim=32", "base_num_decoder_layers=3")
MLA = ("attention_type=mla", "base_num_kv_heads=4", "q_lora_rank=24", "kv_lora_rank=16", "qk_nope_head_dim=16",
       "qk_rope_head_dim=8", "v_head_dim=12")
# (family, HF model_type or None, overrides); vocab 200 pads to 256, which no count includes
CASES = {
    "llama": ("llama", "llama", ()),
    "llama-tied-qwen2": ("llama", "qwen2", ("qkv_bias=true", "logits_via_embedding=true")),
    "mixtral": ("mixtral", "mixtral", MOE),
    "qwen3_moe": ("qwen3_moe", "qwen3_moe", (*MOE, "use_qk_norm=true")),
    "deepseek-gqa": ("deepseek", None, DEEPSEEK_TINY),
    "deepseek_v3": ("deepseek", "deepseek_v3", (*DEEPSEEK_TINY, *MLA, "n_routing_groups=4", "topk_routing_group=2")),
    "deepseek_v2": ("deepseek", "deepseek_v2", (*DEEPSEEK_TINY, *MLA, "q_lora_rank=0", "routed_score_func=softmax",
                                                "routed_bias=false", "norm_topk_prob=false")),
    # multi-token prediction's depth (a layer like the last, its norms and projection): no HF model counts it
    "deepseek_v3-mtp": ("deepseek", None, (*DEEPSEEK_TINY, *MLA, "mtp_num_layers=2")),
}


def built_count(c) -> int:
    """Parameters of the family's module, from its shapes, less the vocabulary's padding rows."""
    model = registry.spec_for(c).build(c)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(shapes)))
    vocab = model.args.vocab
    padding = (vocab.padded - vocab.size) * model.args.embed * (1 if vocab.tied else 2)
    return count - padding


def transformers_count(c) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = hf.hf_config_for(dict(c), "float32", None, None)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(config.pop("model_type"), **config))
    # tied embeddings counted once; DeepSeek-V3's balancing bias is a buffer in its checkpoints
    return (sum(p.numel() for p in model.parameters())
            + sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")))


@pytest.mark.parametrize("case", list(CASES))
def test_each_family_counts_its_parameters_as_its_model_and_transformers_do(tiny_config, case):
    family, hf_type, overrides = CASES[case]
    c = tiny_config("vocab_size=200", f"model_family={family}", *overrides)
    spec = registry.spec_for(c)
    assert spec.name == family
    assert spec.count_params(c, False) == c.num_params == built_count(c)
    if hf_type is None:
        assert c.attention_type == "mla" or registry.spec_for(c).hf is None or _refused(c)
    else:
        assert hf.hf_kind(dict(c)) == hf_type and registry.by_hf_type(hf_type) is spec
        assert transformers_count(c) == c.num_params
    if c.num_experts > 1:  # a token uses its top-k of the routed experts, and no balancing bias
        moe_layers = c.base_num_decoder_layers - c.first_num_dense_layers + c.mtp_num_layers
        unused = moe_layers * 3 * c.base_emb_dim * 32 * (c.num_experts - c.num_experts_per_tok)
        bias = moe_layers * c.num_experts if c.routed_bias else 0
        assert c.num_active_params == c.num_params - unused - bias
    else:
        assert c.num_active_params == c.num_params


def _refused(c) -> bool:
    try:
        hf.hf_kind(dict(c))
    except ConvertError:
        return True
    return False


def test_mtp_depths_count_beside_the_model_transformers_builds(tiny_config):
    with_depths = tiny_config("vocab_size=200", *CASES["deepseek_v3-mtp"][2])
    without = tiny_config("vocab_size=200", *CASES["deepseek_v3-mtp"][2], "mtp_num_layers=0")
    assert transformers_count(with_depths) == without.num_params < with_depths.num_params
    deeper = tiny_config("vocab_size=200", *CASES["deepseek_v3-mtp"][2], "mtp_num_layers=0",
                         f"base_num_decoder_layers={without.base_num_decoder_layers + 1}")
    moe_layer, d = deeper.num_params - without.num_params, without.base_emb_dim
    # each depth: a layer like the last (MoE), its embedding, hidden and output norms, its [2D, D] projection
    assert with_depths.num_params - without.num_params == 2 * (moe_layer + 3 * d + 2 * d * d)


def test_every_hf_type_belongs_to_one_family_and_export_refuses_the_rest():
    types = registry.hf_types()
    assert {"llama", "mistral", "qwen2", "mixtral", "qwen3_moe"} <= set(types)
    assert [registry.by_hf_type(t).name for t in ("llama", "mistral", "qwen2")] == ["llama"] * 3
    assert registry.by_hf_type("qwen2_moe") is None and registry.by_hf_type(["llama"]) is None
    assert registry.family("deepseek").priority > registry.family("mixtral").priority  # it narrows the MoEs


def test_masks_exempt_norms_and_biases_from_decay_and_the_balancing_bias_from_training():
    spec = registry.family("deepseek")
    params = {"moe_layers": {"mlp": {"router": 1, "router_bias": 1, "wo": 1}, "mlp_norm": {"scale": 1},
                             "attention": {"bq": 1, "wq": 1}}, "embedding": 1}
    assert spec.decayed(params) == {"moe_layers": {"mlp": {"router": True, "router_bias": False, "wo": True},
                                                   "mlp_norm": {"scale": False},
                                                   "attention": {"bq": False, "wq": True}}, "embedding": True}
    trained = jax.tree.leaves_with_path(spec.trained(params))
    assert [jax.tree_util.keystr(p) for p, t in trained if not t] == ["['moe_layers']['mlp']['router_bias']"]


@pytest.mark.slow
def test_weight_decay_leaves_the_balancing_bias_to_its_own_rule(tiny_config):
    """AdamW with weight decay once moved DeepSeek's router_bias too (-lr x decay x bias a step). Now each
    step moves it by exactly what moe.update_router_bias gives for that step's recorded expert loads."""
    rate = 0.01
    devices = jax.devices()[:1]
    c = tiny_config(*DEEPSEEK_TINY, "adam_weight_decay=1.0", "learning_rate=1e-2", f"routed_bias_update_rate={rate}",
                    devices=devices)
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        state = trainer.init(jax.random.key(0))
        bias = np.asarray(state.params["moe_layers"]["mlp"]["router_bias"])
        first = np.asarray(state.params["moe_layers"]["mlp"]["router"])
        for step in range(6):
            batch = data.synthetic_batch(step, seed=0, batch=c.global_batch_size, length=c.max_target_length,
                                         vocab=c.vocab_size)
            state, metrics = trainer.train_step(state, batch)
            assert float(metrics["nonfinite"]) == 0.0
            load = jnp.asarray(metrics["expert_load"])  # [moe layers, experts]: what the step moved the bias by
            want = moe.update_router_bias({"moe_layers": {"mlp": {"router_bias": jnp.asarray(bias)}}},
                                          {"moe_layers": {"mlp": {"expert_load": (load,)}}}, rate)
            want = np.asarray(want["moe_layers"]["mlp"]["router_bias"])
            got = np.asarray(state.params["moe_layers"]["mlp"]["router_bias"])
            # An expert whose load is the mean's to the last bit may round either way in another reduction order.
            tie = np.abs(np.asarray(load) - np.asarray(load).mean(axis=-1, keepdims=True)) < 1e-6
            np.testing.assert_array_equal(got[~tie], want[~tie], err_msg=f"step {step + 1}")
            moved = bias[tie][:, None] + np.float32(rate) * np.float32([-1, 0, 1])  # as the rule adds in float32
            assert np.all(np.any(moved == got[tie][:, None], axis=1)), f"step {step + 1}"
            bias = got
    assert np.any(bias != 0)  # the rule did move it
    # and weight decay did act on the router's matrix beside it
    assert not np.array_equal(np.asarray(state.params["moe_layers"]["mlp"]["router"]), first)


def test_families_name_the_keys_they_leave_at_base_yml_and_set_only_their_own_values():
    """base.yml writes each default once: a family lists which keys its HF classes have only at base.yml's value
    (names), and its own settings only where they differ from base.yml."""
    from maxtrain.config import load as config_lib
    from maxtrain.models import deepseek, gemma, gpt_oss
    base = config_lib.defaults()
    for names in (hf.VARIANT_KEYS, deepseek.DEEPSEEK_KEYS, gpt_oss.PLAIN, gemma.PLAIN):
        assert all(isinstance(k, str) and k in base for k in names)
    for traits in (gpt_oss.TRAITS, gemma.TRAITS):
        assert [k for k, v in traits.items() if base[k] == v] == []
    # the plain values follow base.yml: a Llama-shaped config with a base.yml default changed is another variant
    c = config_lib.load([str(config_lib.BASE_YML)])
    assert hf.unexpressed(dict(c), registry.spec_for(c)) is None
    changed = dict(c) | {"attention_sinks": True}
    assert hf.unexpressed(changed, registry.spec_for(c)) == "attention_sinks"
