"""HuggingFace <-> maxtrain parameter checkpoints for the Llama family (Llama, Mistral with its sliding window
or without, Qwen2), its mixtures of experts (Mixtral, Qwen3-MoE) and the other families in maxtrain/models.

Each family's HF layout and config mapping is in its module in maxtrain/models; the file machinery in
maxtrain.checkpoint.hf_format.

    python -m maxtrain.convert hf_to_maxtrain --hf_dir DIR --out DIR [--config x.yml] [key=value ...]
    python -m maxtrain.convert maxtrain_to_hf --checkpoint DIR --out DIR [--dtype bfloat16]

Beyond the weights: import keeps the HF config, tokenizer and generation files under <out>/hf/ and points
the written maxtrain.yml at the tokenizer; export takes them back (from an imported directory, or from the
one a training run started from, or --hf_source), so token ids and context length survive the round trip.

Safety and memory: safetensors only (never pickle). Import reads tensors one at a time (one expert at a
time) from memory maps into the single output copy; export restores one parameter (or one unrolled layer)
at a time, checks it against the step's digest as a restore would, and writes one shard at a time.
Everything is checked before anything is written, and the output appears under its final name only when
complete (maxtrain.checkpoint.staging): a failure leaves nothing at --out.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from maxtrain.checkpoint import hf_tokenizer as export_tokenizer, loading as ckpt_loading
from maxtrain.checkpoint.param_reader import CheckpointParams, get_path
from maxtrain.config import help as cli_help, load as config_lib
from maxtrain.config import schema
from maxtrain.config.groups import training as training_keys
from maxtrain.runtime import errors, platform_env, storage
from maxtrain.runtime.errors import ConvertError
from maxtrain.checkpoint.hf_format import HF_SIDE_FILES, SafetensorsDir, read_json, tokenizer_settings
from maxtrain.models import stacks as stacks_lib
from maxtrain.models.hf import hf_config_for, hf_kind, model_keys_from_hf, supported, with_defaults
from maxtrain.models.hf_layout import Tensor, hf_names
from maxtrain.models.hf_tensors import FUSED_EXPERTS_NAME, LayerTensors, mtp_copies, mtp_depths, tensor_table
from maxtrain.checkpoint.staging import check_out, staged, unwritable


# ---------------------------------------------------------------------------------------------
# hf_to_maxtrain


def _as_override(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def hf_to_maxtrain(hf_dir: str, out: str, config_path: str | None = None, overrides: tuple[str, ...] = ()) -> Path:
    hf_path, out_path = storage.path(hf_dir, "--hf_dir"), storage.absolute(out, "--out")
    check_out(out_path)
    if storage.is_url(hf_path):  # safetensors are read from memory maps: a local copy first
        with tempfile.TemporaryDirectory(prefix="maxtrain-hf-") as local:
            storage.download_tree(hf_path, Path(local))
            return _hf_to_maxtrain(Path(local), out_path, config_path, overrides, shown=str(hf_path))
    return _hf_to_maxtrain(hf_path, out_path, config_path, overrides)


def _hf_to_maxtrain(hf_path: Path, out_path, config_path: str | None, overrides: tuple[str, ...],
                    shown: str | None = None) -> Path:
    hf = read_json(hf_path / "config.json")
    hf_keys = model_keys_from_hf(hf)
    reader = SafetensorsDir(hf_path)
    hf_keys["mtp_num_layers"] = mtp_depths(hf, hf_keys, reader.shapes)  # DeepSeek's, where the files hold them
    base = config_lib.load([config_path or str(config_lib.BASE_YML), *overrides])
    if config_path:  # the named config must describe this very model
        for key, value in hf_keys.items():
            if base[key] != value and key not in schema.in_group("model_training"):
                raise ConvertError(f"{key}: {config_path} says {base[key]!r}, {hf_path}/config.json implies {value!r}")
    c = config_lib.load([config_path or str(config_lib.BASE_YML), *overrides,
                         *(f"{k}={_as_override(v)}" for k, v in hf_keys.items())])
    tokenizer = tokenizer_settings(hf_path, with_defaults(hf), out_path / "hf")

    fused = c.num_experts > 1 and any(name.endswith(FUSED_EXPERTS_NAME) for name in reader.shapes)
    whole, groups = tensor_table(c, fused_experts=fused, hf=hf)
    expected = {t.hf_name: t.hf_shape for t in whole}
    expected |= {name: t.hf_shape for g in groups for i in g.indices for t in g.tensors for name in hf_names(t, i)}
    for name, shape in expected.items():
        if name not in reader.shapes:
            raise ConvertError(f"{name}: missing from {hf_path}")
        if reader.shapes[name] != shape:
            raise ConvertError(f"{name}: shape {list(reader.shapes[name])} in {hf_path}, "
                               f"the config implies {list(shape)}")
    ignored = {"lm_head.weight"} if c.logits_via_embedding else set()  # tied: a copy of the embedding
    ignored |= set(mtp_copies(c))
    extra = sorted(n for n in reader.shapes if n not in expected and n not in ignored and "rotary_emb" not in n)
    if extra:
        raise ConvertError(f"{extra[0]}: unexpected tensor in {hf_path} ({len(extra)} in all); "
                           f"the model is not a plain {hf['model_type']}")

    params = read_hf_params(reader, c, whole, groups)
    with staged(out_path) as tmp:
        try:
            ckpt_loading.save_parameters(tmp, params, c)
        except Exception as e:  # Orbax's writers raise many types; all of them are about --out here
            raise unwritable(out_path, e) from None
        (tmp / "hf").mkdir()
        for name in HF_SIDE_FILES:
            if (hf_path / name).is_file():
                shutil.copy(hf_path / name, tmp / "hf" / name)
        settings = {k: c[k] for k in schema.preset_keys()} | {"weight_dtype": c.weight_dtype} | tokenizer
        if config_path:
            settings = {"base_config": str(config_lib.config_path(config_path).absolute())} | settings  # a shipped one too
        settings["load_parameters_path"] = str(out_path)
        header = (f"# Written by `python -m maxtrain.convert hf_to_maxtrain` from {shown or hf_path.absolute()}.\n"
                  f"# Train from these weights: python -m maxtrain.train {out_path}/maxtrain.yml key=value ...\n")
        (tmp / "maxtrain.yml").write_text(header + yaml.safe_dump(settings, sort_keys=False))
    return out_path


def _host_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An empty array with 64-byte-aligned data: jax.device_put aliases such an array on CPU instead of
    copying it, so a finished parameter costs no second copy."""
    dtype = np.dtype(dtype)
    raw = np.empty(math.prod(shape) * dtype.itemsize + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def read_hf_params(reader: SafetensorsDir, c: config_lib.Config, whole: list[Tensor], groups: list[LayerTensors]):
    """maxtrain's parameter tree, built one HF tensor at a time from memory maps into CPU jax arrays
    (which Orbax writes without another host copy): the peak is the model once, in weight_dtype."""
    dtype = jax.numpy.dtype(c.weight_dtype)
    cpu = jax.local_devices(backend="cpu")[0]

    def load(t: Tensor, layers: list[int | None], stack: bool):
        """One parameter from its HF tensor (or one per expert, stacked on the experts axis), or from those
        of several layers stacked on a leading `layers` axis."""
        names = [hf_names(t, i) for i in layers]
        first = t.to_maxtrain(reader.get(names[0][0]))
        one = (t.experts, *first.shape) if t.experts else first.shape
        out = _host_array((len(names), *one) if stack else one, dtype)
        for i, layer_names in enumerate(names):  # tensor by tensor into their place
            dst = out[i] if stack else out
            for e, name in enumerate(layer_names):
                x = first if (i, e) == (0, 0) else t.to_maxtrain(reader.get(name))
                if t.experts:
                    dst[e] = x
                else:
                    dst[...] = x
        return jax.device_put(out, cpu)  # aliases `out`: no copy

    params: dict[str, Any] = {}
    for t in whole:
        _put(params, t.path, load(t, [None], stack=False))
    for g in groups:
        for t in g.tensors:
            if g.single or c.scan_layers:
                _put(params, g.params_path(t, c.scan_layers), load(t, g.indices, stack=not g.single))
            else:
                for i in g.indices:
                    _put(params, g.params_path(t, False, i), load(t, [i], stack=False))
    return params


def _put(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ---------------------------------------------------------------------------------------------
# maxtrain_to_hf


def find_hf_source(step_dir: Path) -> Path | None:
    """The HF files an imported model came with (<import>/hf/): in an imported directory itself, or in the
    one a training run started from (its <run>/config.yml's load_parameters_path)."""
    if (step_dir / "hf" / "config.json").is_file():
        return step_dir / "hf"
    run_config = step_dir.parent.parent / "config.yml"
    try:
        origin = (yaml.safe_load(run_config.read_text()) or {}).get("load_parameters_path")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    if origin and (storage.path(origin) / "hf" / "config.json").is_file():
        return storage.path(origin) / "hf"
    return None


def maxtrain_to_hf(checkpoint: str, out: str, dtype: str | None = None, max_positions: int | None = None,
                   max_shard_bytes: int = 2 << 30, hf_source: str | None = None) -> Path:
    out_path = storage.absolute(out, "--out")
    check_out(out_path)
    ckpt = CheckpointParams(checkpoint)
    m = ckpt.signature
    if m["base_emb_dim"] % m["base_num_query_heads"]:  # transformers' configs refuse this
        raise ConvertError(f"base_emb_dim={m['base_emb_dim']} is not divisible by base_num_query_heads="
                           f"{m['base_num_query_heads']}: transformers cannot load such a Llama")
    hf_kind(m)  # refuses what no supported HF model expresses
    source_dir = storage.path(hf_source, "--hf_source") if hf_source else find_hf_source(ckpt.step_dir)
    source = read_json(source_dir / "config.json") if source_dir else None
    run = None if source_dir else export_tokenizer.run_settings(ckpt.step_dir)  # a model trained from scratch
    if source:
        theirs = model_keys_from_hf(source)
        # A training setting (the balancing loss weight) goes out as the checkpoint has it.
        differ = [k for k, v in theirs.items() if k in m and m[k] != v and k not in schema.in_group("model_training")]
        if differ:
            raise ConvertError(f"--hf_source {source_dir}: {differ[0]} differs (HF config {theirs[differ[0]]!r}, "
                               f"checkpoint {m[differ[0]]!r})")
    dtype = dtype or np.dtype(ckpt.metadata["embedding"].dtype).name
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    whole, groups = tensor_table(m, joined=True)  # a joined tensor goes out with the parameter it joins

    def split(t: Tensor, i: int, x, joined):  # (HF name, HF array) of a layer's parameter: one, or one per expert
        return zip(hf_names(t, i), (t.to_hf(x[e]) for e in range(t.experts)) if t.experts else [t.to_hf(x, *joined)])

    def tensors():  # (HF name, HF array), one at a time
        for t in whole:
            yield t.hf_name, t.to_hf(ckpt.read(*t.path))
        by_name = {t.hf_name: t for t in whole}
        for name, copied in mtp_copies(m).items():
            t = by_name[copied if copied in by_name else "model.embed_tokens.weight"]  # tied: the embedding
            yield name, t.to_hf(ckpt.read(*t.path))
        for g in groups:
            if m["scan_layers"] and not g.single:
                for t in g.tensors:
                    stacked, joined = ckpt.read(*g.scanned, *t.path), [ckpt.read(*g.scanned, *path) for path in t.joins]
                    for j, i in enumerate(g.indices):
                        yield from split(t, i, stacked[j], [x[j] for x in joined])
            else:
                for i in g.indices:
                    params_i = ckpt.read(g.name if g.single else stacks_lib.unrolled(i))
                    for t in g.tensors:
                        yield from split(t, i, get_path(params_i, t.path), [get_path(params_i, p) for p in t.joins])

    from safetensors.numpy import save_file
    with staged(out_path) as tmp:
        shard_names, current, size = [], {}, 0

        def flush():
            nonlocal current, size
            shard_names.append(list(current))
            try:
                save_file(current, tmp / f"shard-{len(shard_names)}.safetensors", metadata={"format": "pt"})
            except Exception as e:  # safetensors' own error type for a failed write
                raise unwritable(out_path, e) from None
            current, size = {}, 0

        for name, x in tensors():
            current[name] = np.ascontiguousarray(x, dtype=np_dtype)
            size += current[name].nbytes
            if size >= max_shard_bytes:
                flush()
        if current or not shard_names:
            flush()
        _name_shards(tmp, shard_names)
        for name in HF_SIDE_FILES[1:]:  # tokenizer and generation settings; config.json is written below
            if source_dir and (source_dir / name).is_file():
                (tmp / name).write_bytes((source_dir / name).read_bytes())  # new files: the umask's modes
        from_run = export_tokenizer.write(run, tmp) if run else {}
        run_context = from_run.pop("max_position_embeddings", None)  # the run's max_target_length
        hf = hf_config_for(m, dtype, source, max_positions or m.get("max_position_embeddings") or run_context)
        hf |= from_run  # the run's special token ids
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out_path


def _name_shards(tmp: Path, shard_names: list[list[str]]) -> None:
    """HF's file names: model.safetensors, or model-0000i-of-0000n.safetensors plus an index."""
    n = len(shard_names)
    if n == 1:
        (tmp / "shard-1.safetensors").rename(tmp / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shard_names, 1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors"
        (tmp / f"shard-{i}.safetensors").rename(tmp / final)
        weight_map.update({name: final for name in names})
    total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    # Raw: the epilog's lines are commands to copy; argparse would rewrap them at any hyphen.
    types = f"HF model_types converted: {', '.join(supported())} (config.json's model_type)."
    parser = argparse.ArgumentParser(prog="python -m maxtrain.convert", description=f"{__doc__.split(chr(10) * 2)[0]}"
                                     f"\n\n{types}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"python -m maxtrain.convert COMMAND --help: that command's options.\n"
                                            f"{cli_help.where_keys_are()}")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("hf_to_maxtrain", help="HF directory (config.json + safetensors) -> maxtrain checkpoint")
    imp.add_argument("--hf_dir", required=True)
    imp.add_argument("--out", required=True)
    imp.add_argument("--config", help="maxtrain config that must match the HF model (layout, weight dtype)")
    imp.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. scan_layers=false")
    exp = sub.add_parser("maxtrain_to_hf", help="maxtrain checkpoint step directory -> HF directory")
    exp.add_argument("--checkpoint", required=True, help="<run>/checkpoints/<step> or a converted directory")
    exp.add_argument("--out", required=True)
    exp.add_argument("--dtype", choices=training_keys.DTYPES, help="default: the checkpoint's parameter dtype")
    exp.add_argument("--hf_source", help="HF directory whose other settings and tokenizer files to carry over "
                     "(default: found from an imported checkpoint or a run that started from one)")
    exp.add_argument("--max_position_embeddings", type=int, help="default: the model's (the HF source's, or "
                     "the max_position_embeddings key), else the run's max_target_length (else 4096)")
    exp.add_argument("--max_shard_mb", type=int, default=2048, help="safetensors file size limit")
    args = parser.parse_args(argv)
    platform_env.quiet_without_accelerators()

    def run():
        if args.command == "hf_to_maxtrain":
            out = hf_to_maxtrain(args.hf_dir, args.out, args.config, tuple(args.overrides))
            print(f"wrote {out} (load it with load_parameters_path={out}; config: {out}/maxtrain.yml)")
        else:
            out = maxtrain_to_hf(args.checkpoint, args.out, args.dtype, args.max_position_embeddings,
                                 args.max_shard_mb << 20, args.hf_source)
            # transformers reads local directories (or the Hub): a bucket's copy is downloaded first
            where = "a local copy of it" if storage.is_url(out) else repr(str(out))
            print(f"wrote {out} (transformers: AutoModelForCausalLM.from_pretrained({where}))")
    return errors.exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
