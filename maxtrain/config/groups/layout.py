"""The layout keys (group `layout`: how the step lies on the devices, none of which changes what is trained), their
checks, and the platform defaults that their auto values take once the devices are known, so that the plain
command is the fast, lean one on TPU, GPU and CPU (the measurements behind each rule: benchmarks/README.md); an
explicit value always wins."""

from __future__ import annotations

import math
import os

from maxtrain.runtime.declaration import Key, declare
from maxtrain.config.keys import INT_MAX, parallelism_key
from maxtrain.models import quantization, stacks as stacks_lib
from maxtrain.models.parts import padded_vocab
from maxtrain.ops.attention import SPLASH
from maxtrain.parallel import rules
from maxtrain.parallel.mesh import MESH_AXES
from maxtrain.runtime.errors import ConfigError


def _remat_policies() -> tuple[str, ...]:
    from maxtrain.parallel.remat import POLICY_NAMES  # the remat module owns the list of policies
    return POLICY_NAMES


def _share(c) -> int:
    """Each device's positions of a sequence (the mesh is resolved)."""
    return c["max_target_length"] // rules.sequence_shards(c["logical_axis_rules"], c["mesh_shape"])


# ---- attention and the experts' matmul


def attention_for(c, platform: str) -> str:
    """attention=auto: each platform's fast kernel (splash needs each device's positions in blocks of 128;
    beside quantized projections, jax_nn's einsums would be quantized too: see maxtrain.models.quantization)."""
    if platform == "tpu":
        return "splash" if _share(c) % 128 == 0 else "blockwise"
    return "jax_nn" if platform == "gpu" and "attention" not in quantization.targets(c) else "blockwise"


def _splash_blocks(c) -> None:
    if c["attention"] in SPLASH and c["max_target_length"] % 128:
        raise ConfigError("attention", f"{c['attention']} needs max_target_length divisible by 128, got "
                                       f"{c['max_target_length']}")


def _splash_blocks_per_device(c, platform: str) -> None:
    if c["attention"] in SPLASH and _share(c) % 128:
        raise ConfigError("attention", f"{c['attention']} needs each device's share of the sequence in blocks of 128: "
                                       f"{_split(c)}")


def grouped_matmul_for(c, platform: str) -> str:
    """moe_grouped_matmul=auto (maxtrain.ops.grouped_matmul)."""
    return {"tpu": "tokamax", "gpu": "ragged_dot"}.get(platform, "blocked")


def _megablox_on_tpu(c, platform: str) -> None:
    if c["moe_grouped_matmul"] == "megablox" and platform != "tpu" and c["num_experts"] > 1:
        raise ConfigError("moe_grouped_matmul", f"megablox is a TPU kernel (Pallas Mosaic); on {platform} use "
                          f"tokamax, blocked or ragged_dot (auto = {grouped_matmul_for(c, platform)})")


def scan_unroll_for(c, platform: str) -> int:
    """scan_unroll=-1. Under remat_policy=none the scanned loop writes every layer's activations into
    stacked [layers, ...] buffers, which XLA:CPU zero-fills and copies each step; unrolled, each layer's
    stay in their own, which is faster for a shallow model; under remat unrolling was no faster, and it
    costs compile time, as it would for a deep model (benchmarks/README.md has the figures)."""
    layers = c["base_num_decoder_layers"]
    return layers if platform == "cpu" and c["remat_policy"] == "none" and layers <= 8 else 1


# ---- chunks: the MLP's and the loss's positions a piece at a time

MiB = 2**20
# chunk, and the bytes per device of the unchunked tensor above which auto chunks
LOSS_CHUNK = (512, 512 * MiB)  # the float32 logits [rows, length, vocab shard]
MLP_CHUNK = (2048, 128 * MiB)  # one layer's [rows, length, mlp shard] in the compute dtype: long contexts


def _shards(c, logical: str, size: int | None = None) -> int:
    return rules.shards(c["logical_axis_rules"], logical, c["mesh_shape"], size)


def _rows(c) -> float:
    return c["global_batch_size"] / _shards(c, "batch") / c["gradient_accumulation_steps"]


def _itemsize(c) -> int:
    return 2 if c["dtype"] == "bfloat16" else 4


def _auto_chunk(c, tensor_bytes: float, rule: tuple[int, int]) -> int:
    """A divisor of each device's positions up to the rule's chunk, where the unchunked tensor is large."""
    chunk, limit = rule
    length = _share(c)
    divisor = max(d for d in range(1, min(chunk, length) + 1) if length % d == 0)
    return divisor if tensor_bytes > limit and divisor < length else 0


def loss_chunk_for(c, platform: str) -> int:
    vocab = padded_vocab(c["vocab_size"])
    return _auto_chunk(c, _rows(c) * _share(c) * vocab / _shards(c, "vocab", vocab) * 4, LOSS_CHUNK)


def mlp_chunk_for(c, platform: str) -> int:
    mlp = c["base_mlp_dim"]
    return _auto_chunk(c, _rows(c) * _share(c) * mlp / _shards(c, "mlp", mlp) * _itemsize(c), MLP_CHUNK)


def moe_chunk_size(c, given) -> int:
    """An MoE layer's chunk: mlp_chunk_size as `given`, or its auto rule for MoE. Under expert parallelism a
    device receives every peer's assignments to its experts, [rows x length x top-k on its experts x peers,
    expert width] per layer: chunks keep that under the MLP's limit. Without an expert axis, no chunks: the
    gathered weights of all experts and their gradients dominate, and the chunk loop's gradient carry costs
    what the chunks save (Mixtral 8x7B's plans on v5p-128, with and without chunks: benchmarks/README.md)."""
    if given["mlp_chunk_size"] != -1:
        return given["mlp_chunk_size"]
    peers, length = _shards(c, "experts"), _share(c)
    if peers == 1:
        return 0
    per_peer = min(c["num_experts_per_tok"], c["num_experts"] // peers)
    per_position = _rows(c) * per_peer * peers * c["moe_mlp_dim"] / _shards(c, "moe_mlp") * _itemsize(c)
    chunk = max((d for d in range(1, length + 1) if length % d == 0 and d * per_position <= MLP_CHUNK[1]), default=1)
    return chunk if chunk < length else 0


def _split(c) -> str:
    axes = " x ".join(f"{a} ({c['mesh_shape'][a]})" for a in rules.sequence_axes(c["logical_axis_rules"])
                      if c["mesh_shape"][a] > 1)
    return f"max_target_length {c['max_target_length']} / {axes or '1 device'} = {_share(c)}"


def _chunk(key: str):
    def divides_length(c) -> None:
        if c[key] > 0 and c["max_target_length"] % c[key]:
            raise ConfigError(key, f"must be -1 (auto), 0 or divide max_target_length={c['max_target_length']}")

    def divides_share(c, platform: str) -> None:
        if c[key] > 0 and _share(c) % c[key]:
            raise ConfigError(key, f"{c[key]} must divide each device's share of the sequence: {_split(c)}")
    return dict(at_least=0, auto=-1, why="auto", check=divides_length, check_resolved=divides_share)


# ---- the mesh and the pipeline


def _one_fill(group: str):
    def check(c) -> None:
        if [c[parallelism_key(group, a)] for a in MESH_AXES].count(-1) > 1:
            raise ConfigError(f"{group}_*_parallelism", "at most one axis per group may be -1")
    return check


def pipeline_settings(c) -> dict[str, int]:
    """The pipeline's schedule: the pipeline keys with their -1s filled (the stages are known at load: no
    pipeline axis fills), after the checks of docs/parallelism.md "Pipeline parallelism". The pipeline runs the
    model's last stack (a dense model's layers; an MoE model's MoE layers: its leading dense layers run before
    it, on every device, as the embedding does)."""
    stages = c["ici_pipeline_parallelism"] * c["dcn_pipeline_parallelism"]
    last = stacks_lib.for_keys(c)[-1]
    if stages == 1:  # set anyway: a no-effect warning (a pipelined run's config resumed on one stage)
        return {"num_pipeline_microbatches": 1, "num_layers_per_pipeline_stage": last.count, "num_pipeline_repeats": 1}
    if not c["scan_layers"]:
        raise ConfigError("scan_layers", "false cannot run a pipeline: its stages run a scanned stack's layers")
    what = f"the pipeline's {last.count} layers ({last.name})"
    if last.count % stages:
        key = "ici_pipeline_parallelism" if c["ici_pipeline_parallelism"] > 1 else "dcn_pipeline_parallelism"
        raise ConfigError(key, f"{what} do not split into {stages} stages (ici x dcn)")
    share = last.count // stages
    per, repeats = c["num_layers_per_pipeline_stage"], c["num_pipeline_repeats"]
    if per != -1 and share % per:
        raise ConfigError("num_layers_per_pipeline_stage", f"{per} does not divide each stage's {share} layers "
                          f"({what} over {stages} stages)")
    if repeats != -1 and share % repeats:
        raise ConfigError("num_pipeline_repeats", f"{repeats} does not divide each stage's {share} layers "
                          f"({what} over {stages} stages)")
    if per != -1 and repeats != -1 and per * repeats != share:
        raise ConfigError("num_pipeline_repeats", f"{repeats} x num_layers_per_pipeline_stage {per} != each "
                          f"stage's {share} layers ({what} over {stages} stages)")
    if per == -1:
        per = share // (1 if repeats == -1 else repeats)
    micro = stages if c["num_pipeline_microbatches"] == -1 else c["num_pipeline_microbatches"]
    if micro % stages:
        raise ConfigError("num_pipeline_microbatches", f"{micro} is not a multiple of the {stages} stages: a "
                          "micro-batch must be back from the last stage before the first stage takes it again")
    return {"num_pipeline_microbatches": micro, "num_layers_per_pipeline_stage": per,
            "num_pipeline_repeats": share // per}


def _microbatches_split(c, platform: str) -> None:
    """Each micro-batch runs on one stage's devices, split over their batch axes."""
    shape, accum, micro = c["mesh_shape"], c["gradient_accumulation_steps"], c["num_pipeline_microbatches"]
    if shape["stage"] == 1:
        return
    batch_axes, layer_axes = (rules.mesh_axes(c["logical_axis_rules"], (name,))[0]
                              for name in ("batch", "stage_layers"))
    if layer_axes != ["stage"]:  # else every stage would hold (and gather) every layer
        raise ConfigError("logical_axis_rules", "a pipeline needs the rule [\"stage_layers\", \"stage\"] "
                          "(base.yml's): a stage holds only its own layers")
    inner_axes = [a for a in batch_axes if a != "stage" and shape[a] > 1]
    inner, batch = math.prod(shape[a] for a in inner_axes), c["global_batch_size"]
    if batch % (accum * micro * inner):
        per = f" per accumulation step ({batch // accum})" if accum > 1 else ""
        raise ConfigError("num_pipeline_microbatches",
                          f"{micro} micro-batches of the global batch {batch}{per} do not each split "
                          f"over a stage's {inner} batch shards ({' x '.join(inner_axes) or 'none'}): use fewer "
                          "micro-batches or a larger per_device_batch_size")


def _pipeline_key(key: str, **kw) -> Key:
    def no_effect(c) -> str | None:
        stages = c["ici_pipeline_parallelism"] * c["dcn_pipeline_parallelism"]
        if stages == 1 and c[key] not in (-1, pipeline_settings(c)[key]):  # resolved: filled as if unset
            return (f"{key}: {c[key]} has no effect: no pipeline (ici_pipeline_parallelism x "
                    "dcn_pipeline_parallelism = 1)")
        return None
    return layout(key, at_least=1, auto=-1, why="auto", no_effect=no_effect,
                  choose=lambda c, platform: pipeline_settings(c)[key], **kw)


def _rules(c) -> None:
    key, value = "logical_axis_rules", c["logical_axis_rules"]
    if not isinstance(value, list):
        raise ConfigError(key, "must be a list of [logical_name, mesh_axis | [mesh_axes] | null]")
    for rule in value:
        if not (isinstance(rule, list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ConfigError(key, f"bad rule {rule!r}; expected [logical_name, mesh_axes]")
        target = rule[1]
        axes = [] if target is None else [target] if isinstance(target, str) else target
        if not isinstance(axes, list) or any(a not in MESH_AXES for a in axes):
            raise ConfigError(key, f"rule {rule!r}: mesh axes must be among {', '.join(MESH_AXES)}")


# ---- the input pipeline's processes

STREAMED = ("text", "parquet", "array_record")


def data_workers_for(c, platform: str) -> int:
    """grain_worker_count=-1: processes reading and tokenizing streamed files beside the step. On CPU the step
    needs the cores (2 workers here: 1.5x the pipeline's own rate, taken from the step's cores); beside an
    accelerator, one per 8 cores up to 8 (the HF and sentencepiece tokenizers use a thread's spare cores
    themselves; the workers spread the reading and parsing). Prepared and synthetic data need none."""
    if platform == "cpu" or not (c["dataset_type"] in STREAMED or c["data_sources"]):
        return 0
    return max(1, min(8, (os.cpu_count() or 1) // 8))


def layout(name: str, **kw) -> Key:
    return Key(name, "layout", **kw)


def _parallelism(group: str, axis: str, **kw) -> Key:
    """A mesh axis's size in `group` (ici or dcn); one axis of a group may be -1, filling the rest (not the
    pipeline's: its stages are known at load)."""
    fill = dict(auto=-1, why="fill") if axis != "stage" else {}
    return layout(parallelism_key(group, axis), at_least=1, **fill, **kw)


declare(
    layout("attention", choices=("auto", "dot_product", "blockwise", "jax_nn", *SPLASH), auto="auto",
           choose=attention_for, check=_splash_blocks, check_resolved=_splash_blocks_per_device),
    layout("moe_grouped_matmul", choices=("auto", "tokamax", "megablox", "ragged_dot", "blocked"), auto="auto",
           choose=grouped_matmul_for, check_resolved=_megablox_on_tpu),
    layout("scan_unroll", at_least=1, auto=-1, why="auto", choose=scan_unroll_for),
    layout("optimizer_memory_host_offload"),
    layout("parameter_memory_host_offload"),
    layout("remat_policy", choices=_remat_policies),
    layout("mlp_chunk_size", choose=mlp_chunk_for, **_chunk("mlp_chunk_size")),
    _parallelism("ici", "stage", check=_one_fill("ici")),
    _parallelism("dcn", "stage", check=_one_fill("dcn")),
    _pipeline_key("num_pipeline_microbatches", check=pipeline_settings, check_resolved=_microbatches_split),
    _pipeline_key("num_layers_per_pipeline_stage"),
    _pipeline_key("num_pipeline_repeats"),
    *(_parallelism(group, axis) for group in ("ici", "dcn") for axis in MESH_AXES if axis != "stage"),
    layout("context_parallel_load_balance"),
    layout("context_parallel_strategy", choices=("all_gather", "ring")),
    layout("logical_axis_rules", check=_rules),
    layout("per_device_batch_size", above=0, limit=(INT_MAX, "sequences; the global batch reaches jax as int32")),
    layout("loss_chunk_size", choose=loss_chunk_for, **_chunk("loss_chunk_size")),
    layout("grain_worker_count", at_least=0, auto=-1, why="auto", choose=data_workers_for),
    layout("prepare_workers", at_least=1, auto=-1, why="auto"),
    layout("compile_topology"),
    layout("compile_topology_num_slices", at_least=1),
)
