"""Fault injection for the tools (convert, generate, compile): an export verifies what it reads as a
restore does, an unwritable --out, a missing libtpu, a buffer that cannot fit and an unknown special
token are each one line and an exit code, with nothing half-written."""

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from maxtrain.checkpoint import manager as ckpt_lib
from maxtrain import compile as compile_lib, convert, generate, train
from maxtrain.observe import fit
from conftest import TESTS, TINY, tmpfs, xla_flags
from helpers import Output, main_in_process, one_line, popen_as_from_a_terminal

ENV = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")


def run_module(module: str, *args, env=None, timeout=300):
    """A tool as a user runs it: (exit code, stdout, stderr, seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=TESTS.parent, env=env or ENV)
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0


def train_tiny_to_step_2(out: Path, *overrides) -> Path:
    """Step 2 of a tiny training run (with its digest)."""
    c = train.load_config([TINY, f"base_output_directory={out}", "enable_checkpointing=true", "steps=2",
                           "checkpoint_period=2", *overrides])
    train.train(c)
    return out / "tiny" / "checkpoints" / "2"


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory) -> Path:
    return train_tiny_to_step_2(tmp_path_factory.mktemp("run"))


def flip_one_bit_in_a_parameter(step: Path, array: str = "params.embedding") -> None:
    """One flipped bit in the stored (zstd-compressed) bytes of one chunk of a parameter, at a place where
    the chunk still decodes: bit rot that Orbax does not notice, so a restore reads a changed value."""
    import numpy as np
    import tensorstore as ts
    base = {"driver": "ocdbt", "base": f"file://{step / 'state'}/"}
    kv = ts.KvStore.open(base).result()
    key = next(k for k in kv.list().result() if k.startswith(f"{array}/".encode()) and not k.endswith(b".zarray"))
    chunk = kv.read(key).result().value
    data = next(f for f in (step / "state").rglob("*") if f.is_file() and chunk in f.read_bytes())
    blob = bytearray(data.read_bytes())
    start = blob.find(chunk)

    def read():
        return ts.open({"driver": "zarr", "kvstore": {**base, "path": f"{array}/"}}).result().read().result()
    before = read()
    for i in range(start + len(chunk) // 2, start + len(chunk)):
        blob[i] ^= 0x10
        data.write_bytes(bytes(blob))
        try:
            decoded_differently = not np.array_equal(read(), before)
        except ValueError:  # this flip breaks the compressed stream: try the next byte
            decoded_differently = False
        if decoded_differently:
            return
        blob[i] ^= 0x10
    raise AssertionError(f"no single-bit flip in {key} decodes")


@pytest.fixture
def damaged_step(step_dir, tmp_path) -> Path:
    damaged = tmp_path / "checkpoints" / "2"
    shutil.copytree(step_dir, damaged)
    flip_one_bit_in_a_parameter(damaged)
    return damaged


def nothing_at(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))


# ---- exports and generation verify the digest -------------------------------------------------

@pytest.mark.slow
def test_export_of_a_damaged_step_is_refused_and_writes_nothing(damaged_step, tmp_path):
    out = tmp_path / "hf"
    code, stdout, err, _ = run_module("maxtrain.convert", "maxtrain_to_hf", "--checkpoint", str(damaged_step),
                                      "--out", str(out))
    line = one_line(err)
    assert code == 2 and line.startswith(f"checkpoint error: --checkpoint: {damaged_step} does not match its "
                                         f"digest (1 arrays differ from their checksums (first: .params["), err
    assert line.endswith("the checkpoint is damaged; nothing written") and nothing_at(out)


@pytest.mark.slow
def test_generate_and_resume_refuse_the_same_step(damaged_step, capsys):
    code = generate.main([TINY, f"load_parameters_path={damaged_step}", "prompt_ids=1,2,3", "max_new_tokens=2"])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and line.startswith(f"checkpoint error: load_parameters_path: {damaged_step} does not match "
                                         f"its digest"), line
    run_dir = damaged_step.parent.parent
    code, err = main_in_process([TINY, f"base_output_directory={run_dir.parent}", f"run_name={run_dir.name}",
                                 "enable_checkpointing=true", "steps=3"], capsys)
    assert code == 2 and "no usable checkpoint" in one_line(err) and "differ from their checksums" in err


@pytest.mark.slow
def test_an_intact_step_still_exports(step_dir, tmp_path):
    # Stacked layers (read one parameter at a time) and unrolled ones (one layer at a time): every
    # array read matches its digest entry.
    unrolled = train_tiny_to_step_2(tmp_path / "unrolled", "scan_layers=false")
    for i, step in enumerate([step_dir, unrolled]):
        out = convert.maxtrain_to_hf(str(step), str(tmp_path / f"hf{i}"))
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    flip_one_bit_in_a_parameter(unrolled, "params.layers_1.mlp.wo")
    with pytest.raises(ckpt_lib.CheckpointError, match=r"differ from their checksums \(first: "
                                                         r"\.params\['layers_1'\]\['mlp'\]\['wo'\]\)"):
        convert.maxtrain_to_hf(str(unrolled), str(tmp_path / "hf2"))
    assert nothing_at(tmp_path / "hf2")


# ---- an --out that cannot be written ------------------------------------------------------------

@pytest.fixture
def hf_dir(step_dir, tmp_path_factory) -> Path:
    """An HF directory (exported from the tiny run), to import."""
    return convert.maxtrain_to_hf(str(step_dir), str(tmp_path_factory.mktemp("hf") / "hf"))


def conversions(step_dir: Path, hf_dir: Path, out: Path):
    return {"maxtrain_to_hf": ["maxtrain_to_hf", "--checkpoint", str(step_dir), "--out", str(out)],
            "hf_to_maxtrain": ["hf_to_maxtrain", "--hf_dir", str(hf_dir), "--out", str(out)]}


@pytest.mark.parametrize("command", ["maxtrain_to_hf", "hf_to_maxtrain"])
def test_a_file_in_the_way_of_out(command, step_dir, hf_dir, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = blocker / "sub" / "model"
    assert convert.main(conversions(step_dir, hf_dir, out)[command]) == 2
    assert one_line(capsys.readouterr().err) == (f"convert error: --out: cannot write {out}: {blocker} is a file, "
                                                 f"not a directory")
    assert blocker.read_text() == "not a directory"


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody may write to: by its mode, or (as root, whom modes do not stop) a read-only
    tmpfs where this machine lets the tests mount one."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    with tmpfs(d, "size=1m,ro"):
        yield d


@pytest.mark.parametrize("command", ["maxtrain_to_hf", "hf_to_maxtrain"])
def test_a_read_only_out(command, step_dir, hf_dir, read_only_dir, capsys):
    out = read_only_dir / "new" / "model"
    assert convert.main(conversions(step_dir, hf_dir, out)[command]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"convert error: --out: cannot write {out}: ") and (
        "Read-only file system [errno 30]" in line or "Permission denied [errno 13]" in line), line
    assert not any(read_only_dir.iterdir())


@pytest.fixture
def tiny_disk(tmp_path):
    """A 128 KiB tmpfs: less than the tiny model's weights."""
    with tmpfs(tmp_path / "disk", "size=128k") as d:
        yield d


@pytest.mark.parametrize("command", ["maxtrain_to_hf", "hf_to_maxtrain"])
def test_a_disk_that_fills_during_the_write_leaves_nothing(command, step_dir, hf_dir, tiny_disk, capsys):
    out = tiny_disk / "model"
    assert convert.main(conversions(step_dir, hf_dir, out)[command]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"convert error: --out: cannot write {out}: ") and "No space left on device" in line, line
    assert not any(tiny_disk.iterdir())


# ---- compile without libtpu; --help -------------------------------------------------------------

def tpu_extras_libtpu() -> str:
    """The libtpu requirement of pyproject.toml's tpu extra, read from the file itself."""
    extras = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return next(r for r in extras["tpu"] if r.startswith("libtpu"))


def test_the_installed_libtpu_is_the_tpu_extras():
    """Every memory figure in the docs comes from the tpu extra's libtpu (MaxText's install takes the same):
    the one these compile tests run on must be it."""
    assert f"libtpu=={importlib.metadata.version('libtpu')}" == tpu_extras_libtpu()


def test_compile_without_libtpu_is_one_line(tmp_path):
    fake = tmp_path / "site" / "libtpu"  # shadows the installed package, as if it were not installed
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("No module named \'libtpu\'")\n')
    env = {k: v for k, v in ENV.items() if k != "TPU_LIBRARY_PATH"}  # set once jax has loaded libtpu here
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), str(TESTS.parent)])
    code, _, err, seconds = run_module("maxtrain.compile", TINY, "compile_topology=v5e-4", env=env)
    assert code == 2 and one_line(err) == ('compile error: compile_topology=v5e-4 needs libtpu, which is not '
                                           'installed: install it with `pip install -e ".[tpu]"` (or '
                                           f'`pip install "{tpu_extras_libtpu()}"`)'), err[-2000:]
    assert seconds < 60


@pytest.mark.parametrize("tool", [compile_lib, generate])
def test_help_prints_usage(tool, capsys):
    assert tool.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m {tool.__name__} CONFIG.yml") and "Traceback" not in out
    assert tool.main([]) == 2 and capsys.readouterr().err.startswith("usage:")


# ---- generation that cannot fit ----------------------------------------------------------------

@pytest.mark.parametrize("n", [100000, 2147483647])
def test_max_new_tokens_past_the_context_is_refused_at_once(n, step_dir, capsys):
    t0 = time.perf_counter()
    code = generate.main([TINY, f"load_parameters_path={step_dir}", "prompt_ids=1,2,3", f"max_new_tokens={n}"])
    assert code == 2 and one_line(capsys.readouterr().err) == (
        f"config error: max_new_tokens: {n} after a 3-token prompt exceeds max_target_length=32, the context the "
        f"model runs at: at most 29 (raise max_target_length to go further)")
    assert time.perf_counter() - t0 < 10


def test_a_prompt_that_fills_the_context_is_refused(step_dir, capsys):
    ids = ",".join(["5"] * 32)
    assert generate.main([TINY, f"load_parameters_path={step_dir}", f"prompt_ids={ids}"]) == 2
    assert one_line(capsys.readouterr().err) == ("config error: prompt_ids: 32 tokens leave no room for new ones in "
                                                 "max_target_length=32")


@pytest.mark.slow
def test_a_cache_that_does_not_fit_the_device_is_refused_before_it_runs(step_dir, capsys, monkeypatch):
    # Here a device with 1 KiB: the compiled prefill's and decode's footprints are checked before the first token.
    monkeypatch.setattr(fit, "device_memory", lambda device: (1024.0, "a 1 KiB test device"))
    code = generate.main([TINY, f"load_parameters_path={step_dir}", "prompt_ids=1,2,3", "max_new_tokens=29"])
    line = one_line(capsys.readouterr().err)
    # 8 rows: one per batch shard (fsdp=8); a 3-token prompt pads to 16 slots, 16 + 28 new ones pad to 48
    assert code == 2 and line.startswith("memory error: max_new_tokens: 29 after prompts of up to 16 tokens, 8 at a "
                                         "time, makes a KV cache of 48 slots ("), line
    assert line.endswith("more than the 0.00 GiB a device has (a 1 KiB test device); lower max_new_tokens or "
                         "generate_batch_size"), line


def test_max_new_tokens_within_the_context_runs(step_dir, capsys):
    assert generate.main([TINY, f"load_parameters_path={step_dir}", "prompt_ids=1,2,3", "max_new_tokens=29"]) == 0
    assert "generated ids: [" in capsys.readouterr().out


# ---- special tokens the tokenizer lacks ---------------------------------------------------------

@pytest.mark.parametrize("key", ["hf_bos_token", "hf_eos_token"])
def test_an_unknown_special_token_is_one_line(key, hf_tokenizer_json, step_dir, tmp_path, capsys):
    tok = ["tokenizer_type=huggingface", f"tokenizer_path={hf_tokenizer_json}", "vocab_size=640",
           "hf_bos_token=<s>", "hf_eos_token=</s>", f"{key}=<|nope|>"]
    expected = f"config error: {key}: '<|nope|>' is not a token of {hf_tokenizer_json}"
    code, err = main_in_process([TINY, f"base_output_directory={tmp_path}", "dataset_type=text",
                                 f"train_files={TESTS.parent / 'data' / 'tinyshakespeare.txt'}", *tok], capsys)
    assert code == 2 and one_line(err) == expected
    code = generate.main([TINY, f"load_parameters_path={step_dir}", "prompt=ROMEO:", *tok])
    assert code == 2 and one_line(capsys.readouterr().err) == expected


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_aot_compile_is_one_line_not_libtpus_stack_dump(signum):
    """libtpu installs its own SIGTERM handler when it loads (a stack dump, then the signal again)."""
    proc = popen_as_from_a_terminal([sys.executable, "-m", "maxtrain.compile", "configs/base.yml",
                                     "compile_topology=v5p-8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, cwd=TESTS.parent)
    output = Output(proc)
    output.wait_for(r"^compiling the train step for v5p-8", timeout=240)  # libtpu is loaded: its handler is in place
    proc.send_signal(signum)
    _, _, err = output.finish(timeout=60)
    what = "stopped by SIGTERM" if signum == signal.SIGTERM else "interrupted by Ctrl-C"
    assert err == f"{what} during the compile: nothing written\n"
    assert proc.returncode == (143 if signum == signal.SIGTERM else 130)
