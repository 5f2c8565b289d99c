"""Quantized training (`quantization: int8 | fp8 | fp8_full`) through Qwix.

Qwix intercepts the model's `jnp.einsum` calls inside the modules its rules name and runs them on
8-bit operands, scaled per channel (absmax, recomputed every step), with a custom gradient that runs
the backward matmuls on 8-bit operands too where the mode says so. The parameters, the optimizer state
and checkpoints are exactly those of the float model: a checkpoint trained quantized loads unquantized
and back. Only matmuls with a weight operand are quantized (the projections and the MLP); attention's
scores and values (splash is a kernel; blockwise and dot_product run their einsums under a custom
gradient Qwix does not reach; jax_nn's would be quantized, so it is refused), the router and the
output logits stay in the compute dtype. tests/test_quantization.py checks each in the lowered step.
"""

from __future__ import annotations

from typing import Any

from maxtrain.runtime.errors import UserError
from maxtrain.models import registry

# mode: (forward weights and activations, backward gradients; None: the backward in the compute dtype)
MODES = {
    "int8": ("int8", "int8"),                         # MaxText's int8 training: both passes in int8
    "fp8": ("float8_e4m3fn", None),                   # forward in e4m3, backward unquantized
    "fp8_full": ("float8_e4m3fn", "float8_e5m2"),     # and the gradients in e5m2 (wider range)
}
TARGETS = ("attention", "mlp")


def targets(c) -> list[str]:
    """The targets named, when quantization is on."""
    return c["quantization_targets"].split(",") if c["quantization"] else []


def validate(c: dict[str, Any], error: type[UserError]) -> None:
    """Refuses targets Qwix cannot find, before anything compiles."""
    named = targets(c)
    if len(set(named)) < len(named):
        raise error("quantization_targets", f"{c['quantization_targets']!r} names a target twice")
    for target in named:
        if target == "output":
            raise error("quantization_targets", "the output layer stays in the compute dtype: the loss forms "
                        "the logits outside the model, where no rule reaches; use attention and/or mlp")
        if target not in TARGETS:
            raise error("quantization_targets", f"{target!r} is not one of {', '.join(TARGETS)} "
                        "(comma-separated)")
    if (named == ["mlp"] and c["num_experts"] > 1 and not c["first_num_dense_layers"]
            and not c["shared_experts"]):
        raise error("quantization_targets", "an MoE model's only MLPs are its routed experts, which Qwix does "
                    "not reach (grouped-matmul kernels): nothing would be quantized; add attention")
    if c["attention"] == "jax_nn" and "attention" in named:
        # jax.nn.dot_product_attention's XLA path is einsums inside the attention module: Qwix would
        # quantize the scores too
        raise error("attention", "jax_nn cannot run beside quantized attention projections; use "
                    "attention=splash, blockwise or dot_product, or quantization_targets=mlp")


def quantize(model, c):
    """The model with its matmuls quantized as the config says (the model itself if not)."""
    if not c.quantization:
        return model
    import qwix  # only quantized runs load it

    forward, backward = MODES[c.quantization]
    paths = registry.spec_for(c).quantization_paths(c)  # the family knows its modules
    rules = [qwix.QtRule(module_path=paths[t], weight_qtype=forward, act_qtype=forward, bwd_qtype=backward,
                         op_names=("einsum",))
             for t in targets(c) if t in paths]
    return qwix.quantize_model(model, qwix.QtProvider(rules))
