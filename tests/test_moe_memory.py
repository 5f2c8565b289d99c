"""What the MoE train step's TPU compile holds under a mesh (`maxtrain.compile` for a TPU topology on
this CPU machine, libtpu's own partitioner): no collective gathers the whole batch's activations onto
each device. At gpt-oss-120b's size on v5p-128 with experts x fsdp, one such buffer was 11 GiB a chip."""

import os
import re
import subprocess
import sys

import pytest

from conftest import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVE = re.compile(r"= (.*?) (?:all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\(")
GPT_OSS_MOE = ["model_family=mixtral", "num_experts=8", "num_experts_per_tok=2", "mlp_bias=true", "router_logit_bias=true",
               "mlp_activation=clamped_swiglu"]


def collective_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The shapes of every collective's results (each part of a tuple)."""
    return [tuple(int(n) for n in dims.split(",") if n) for line in hlo.splitlines()
            for result in COLLECTIVE.findall(line) for dims in re.findall(r"\w+\[([\d,]*)\]", result)]


def compiled_step_hlo(tmp_path, *args) -> str:
    """The train step's optimized HLO, as libtpu compiles it for v5p-16 (8 chips)."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=jit_step"}
    proc = subprocess.run([sys.executable, "-m", "maxtrain.compile", str(TINY), "compile_topology=v5p-16", *args],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Autotuning cache miss" not in proc.stderr  # Tokamax's ~1 kB warnings, one per kernel traced
    dumps = sorted(tmp_path.glob("*jit_step*after_optimizations.txt"))
    assert len(dumps) == 1, sorted(p.name for p in tmp_path.iterdir())
    return dumps[0].read_text()


@pytest.mark.slow
def test_the_down_bias_gathers_no_batch(tmp_path):
    """gpt-oss's MoE under experts 4 x fsdp 2: no collective result spans the whole batch's rows (a
    dimension of the global batch, 16, beside one of the sequence length, 48; sizes unlike the model's
    others). The down bias, multiplied outside the experts' work as stored (its experts on the axis
    that also splits the batch), had its gradient formed from the whole batch's [16, 48, 64] output
    gradient and [16, 48, 2] routing weights, gathered onto every chip."""
    hlo = compiled_step_hlo(tmp_path, *GPT_OSS_MOE, "ici_expert_parallelism=4", "ici_fsdp_parallelism=2",
                            "per_device_batch_size=2", "max_target_length=48", "moe_grouped_matmul=blocked")
    shapes = collective_shapes(hlo)
    assert len(shapes) > 4, "too few collectives found: the pattern no longer reads the HLO"
    assert [s for s in shapes if 16 in s and 48 in s] == []


@pytest.mark.slow
def test_the_tokamax_grouped_matmul_compiles_for_tpu(tmp_path):
    """moe_grouped_matmul=tokamax in a TPU compile from this CPU process: Tokamax's Pallas grouped matmul
    (forward and gradients) where the widths are TPU-sized (128), XLA's ragged_dot where its kernel
    refuses narrower ones (64), not a traceback."""
    def kernels(*args):
        hlo = compiled_step_hlo(tmp_path / str(len(list(tmp_path.iterdir()))), "model_family=mixtral",
                                "num_experts=8", "num_experts_per_tok=2", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2",
                                "per_device_batch_size=2", "max_target_length=48", "moe_grouped_matmul=tokamax", *args)
        return len(re.findall(r'op_name="[^"]*pallas_tpu_ragged_dot_gmm[^"]*pallas_call"', hlo))
    assert kernels("base_emb_dim=128", "base_moe_mlp_dim=128") >= 3  # gate, up, down; and their gradients
    assert kernels() == 0
