"""Paths are URLs where the user gives a URL: runs, checkpoints, resume, data, tokenizers and HF export on
gs://, tested for real against a local GCS emulator (STORAGE_EMULATOR_HOST); an unusable scheme is one line."""

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import SHAKESPEARE, TESTS, TINY, xla_flags
from test_checkpoint import cli, finish, params_equal_bitwise, saved_params, wait_for_line
from helpers import main_in_process, one_line

from maxtrain import convert
from maxtrain.runtime import storage
from maxtrain.data import tokenizer as tokenizer_lib

BUCKET = "bucket"


@pytest.fixture(scope="module")
def gcs():
    """A gcp-storage-emulator on a free local port with one bucket, STORAGE_EMULATOR_HOST pointing at it
    (for this process and the ones it starts); yields the bucket's URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(TESTS / "gcs_emulator.py"), str(port), BUCKET],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
                                            "GOOGLE_AUTH_TOKEN_FOR_TESTING", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    storage._configured = False  # wire this process's clients to the emulator, as a fresh process would
    storage.configure()
    try:
        yield f"gs://{BUCKET}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        storage._configured = False


def gs_files(url: str) -> list[str]:
    import fsspec
    return sorted(f"gs://{f}" for f in fsspec.filesystem("gs").find(url.removeprefix("gs://")))


# ---- unusable schemes: one line naming the key, nothing made locally ---------------------------------

@pytest.mark.parametrize("override, expected", [
    ("base_output_directory=foo://x/runs",
     "config error: base_output_directory: foo://x/runs: unsupported scheme foo:// (use a local path, gs:// or s3://)"),
    ("load_parameters_path=s3://b/ckpt/5",
     "config error: load_parameters_path: s3://b/ckpt/5: s3:// needs the s3fs package: pip install s3fs"),
    ("train_files=data/a.txt,ftp://h/b.txt",
     "config error: train_files: ftp://h/b.txt: unsupported scheme ftp:// (use a local path, gs:// or s3://)"),
])
def test_an_unusable_scheme_is_one_line(override, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = main_in_process([TINY, "dataset_type=text", "train_files=x.txt", override], capsys)
    assert (code, one_line(err)) == (2, expected)
    assert list(tmp_path.iterdir()) == []  # no ./foo:/x/runs


def test_a_url_without_a_bucket_is_one_line(capsys, tmp_path, monkeypatch):
    """base_output_directory=gs:// wrote under gs://<run_name>, the run's name taken for a bucket, and said
    nothing for 90 s."""
    monkeypatch.chdir(tmp_path)
    code, err = main_in_process([TINY, "base_output_directory=gs://"], capsys)
    assert (code, one_line(err)) == (2, "config error: base_output_directory: 'gs://' names no bucket (e.g. "
                                        "gs://BUCKET/path)")


def test_a_store_that_cannot_be_reached_is_one_line_naming_it(monkeypatch, tmp_path):
    """A glob of train_files was a 120-line aiohttp traceback; a load_parameters_path said it was not a
    checkpoint. Here the store's client fails at once, as it does after its retries (34 s for a glob, 68 s
    for a bucket's existence against a closed port, measured with STORAGE_EMULATOR_HOST=http://127.0.0.1:9)."""
    import aiohttp
    import fsspec
    from maxtrain.checkpoint import loading

    class Unreachable:  # fsspec.filesystem("gs"), as gcsfs is once its retries are spent
        def glob(self, *args, **kwargs):
            raise aiohttp.ClientConnectorError(None, OSError(111, "Connect call failed ('127.0.0.1', 9)"))
        exists = glob
    monkeypatch.setattr(fsspec, "filesystem", lambda protocol, **options: Unreachable())
    said = r"cannot reach gs://nobucket \(.*Connect call failed.*; the client retried for \d+ s\)"
    with pytest.raises(storage.StorageError, match=rf"^train_files: {said}$"):
        storage.glob("gs://nobucket/corpus/*.txt", "train_files")
    with pytest.raises(storage.StorageError, match=rf"^load_parameters_path: {said}$"):
        loading.step_directory("gs://nobucket/run/checkpoints/5", "load_parameters_path")


def test_gs_without_gcsfs_says_what_to_install(capsys, monkeypatch):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else find_spec(name, *a))
    code, err = main_in_process([TINY, "base_output_directory=gs://b/runs"], capsys)
    assert (code, one_line(err)) == (2, "config error: base_output_directory: gs://b/runs: gs:// needs the gcsfs "
                                        "package: pip install 'maxtrain[gcs]'")


def test_export_to_an_unusable_scheme_is_one_line(capsys, tmp_path):
    assert convert.main(["maxtrain_to_hf", "--checkpoint", str(tmp_path), "--out", "foo://x/hf"]) == 2
    assert one_line(capsys.readouterr().err) == ("config error: --out: foo://x/hf: unsupported scheme foo:// "
                                                 "(use a local path, gs:// or s3://)")


# ---- against the emulator ----------------------------------------------------------------------------

def test_atomic_write_and_append_on_gcs(gcs):
    p = storage.path(f"{gcs}/unit/trust.json")
    storage.write_atomic(p, '{"a": 1}')
    storage.write_atomic(p, '{"a": 2}')
    assert p.read_text() == '{"a": 2}' and gs_files(f"{gcs}/unit") == [f"{gcs}/unit/trust.json"]  # no .tmp
    f = storage.open_append(storage.path(f"{gcs}/unit/log.jsonl"))
    f.write("one\n")
    f.flush()
    f.close()
    f = storage.open_append(storage.path(f"{gcs}/unit/log.jsonl"))
    f.write("two\n")
    f.close()
    assert storage.path(f"{gcs}/unit/log.jsonl").read_text() == "one\ntwo\n"
    assert storage.glob(f"{gcs}/unit/*.json", "k") == [f"{gcs}/unit/trust.json"]
    assert storage.glob(f"{gcs}/**/*.jsonl", "k") == [f"{gcs}/unit/log.jsonl"]
    # A log line does not upload the whole object each time: the first flush does, then at most every
    # UPLOAD_SECONDS; close always.
    log = storage.path(f"{gcs}/unit/often.jsonl")
    f = storage.open_append(log)
    f.write("1\n")
    f.flush()
    f.write("2\n")
    f.flush()
    assert log.read_text() == "1\n"
    f.close()
    assert log.read_text() == "1\n2\n"
    # Directories never match, on a bucket as on disk; an upper-case scheme is the same scheme.
    storage.path(f"{gcs}/dirs/sub/x.txt").write_text("x")
    storage.path(f"{gcs}/dirs/y.txt").write_text("y")
    assert storage.glob(f"{gcs}/dirs/*", "k") == [f"{gcs}/dirs/y.txt"]
    assert storage.path(f"GS://{BUCKET}/dirs/y.txt").read_text() == "y"


def test_a_local_glob_skips_directories(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("a")
    assert storage.glob(f"{tmp_path}/*", "k") == [f"{tmp_path}/a.txt"]


def test_tokenizer_from_gcs(gcs, hf_tokenizer_json, tiny_config):
    url = f"{gcs}/tok/tokenizer.json"
    storage.path(url).write_bytes(hf_tokenizer_json.read_bytes())
    args = ("tokenizer_type=huggingface", "vocab_size=640")
    remote = tokenizer_lib.make_tokenizer(tiny_config(*args, f"tokenizer_path={url}"))
    local = tokenizer_lib.make_tokenizer(tiny_config(*args, f"tokenizer_path={hf_tokenizer_json}"))
    text = "To be, or not to be"
    assert remote.encode(text).tolist() == local.encode(text).tolist() and remote.vocab_size == local.vocab_size


@pytest.mark.slow
def test_train_sigterm_resume_on_gcs_matches_a_local_run_bitwise(gcs, tmp_path):
    """Outputs on gs://: killed (SIGTERM) mid-run, resumed from the bucket, the final parameters equal a
    straight local run's bit for bit; metrics, trust verdicts, config and tensorboard land in the bucket."""
    args = ("steps=12", "checkpoint_period=2", "log_period=1", "learning_rate_schedule_steps=12",
            "metrics_backends=tensorboard,jsonl", "max_num_checkpoints_to_keep=2")
    code, _, err = finish(cli(*args, out=tmp_path))
    assert code == 0, err[-2000:]
    runs = f"{gcs}/runs"
    proc = cli(*args, out=runs)
    wait_for_line(proc, "step  3/12 |")
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)
    assert code == 0, err[-2000:]
    stopped = [x for x in out.splitlines() if "stopped by SIGTERM" in x]
    assert stopped and "checkpoint saved" in stopped[0], out[-2000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert step < 12
    code, out, err = finish(cli(*args, out=runs))
    assert code == 0, err[-2000:]
    assert f"resumed from {runs}/tiny/checkpoints/{step}" in out
    assert params_equal_bitwise(saved_params(storage.path(f"{runs}/tiny/checkpoints/12")),
                                saved_params(tmp_path / "tiny" / "checkpoints" / "12"))
    files = gs_files(f"{runs}/tiny")
    assert not any(f.startswith(f"{gcs}/runs/tiny/gs:") for f in files)
    assert {f"{runs}/tiny/{f}" for f in ("config.yml", "metrics.jsonl", "checkpoints/trust.json")} <= set(files)
    assert sorted({int(f.split("/checkpoints/")[1].split("/")[0]) for f in files if "/checkpoints/" in f and
                   f.split("/checkpoints/")[1].split("/")[0].isdigit()}) == [10, 12]  # retention on the bucket
    assert any("/tensorboard/events.out.tfevents." in f for f in files)
    rows = [json.loads(x) for x in storage.path(f"{runs}/tiny/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "start" not in r] == list(range(1, 13))  # each step once
    assert [r["step"] for r in rows if "start" in r] == [0, step]  # each start's record
    trust = json.loads(storage.path(f"{runs}/tiny/checkpoints/trust.json").read_text())
    assert 10 in trust["trusted"]
    assert not (TESTS.parent / "gs:").exists()


@pytest.mark.slow
def test_data_from_gcs_and_export_to_gcs(gcs, tmp_path, capsys):
    """Train and eval files read from the bucket (a glob), then the run's checkpoint exported to HF format
    on the bucket: the same files, byte for byte, as an export to a local directory."""
    text = SHAKESPEARE.read_text()
    storage.path(f"{gcs}/data/train/a.txt").write_text(text[:60_000])
    storage.path(f"{gcs}/data/train/b.txt").write_text(text[60_000:120_000])
    storage.path(f"{gcs}/data/eval.txt").write_text(text[-20_000:])
    runs = f"{gcs}/datarun"
    code, out, err = finish(cli("steps=4", "checkpoint_period=4", "dataset_type=text", "vocab_size=384",
                                f"train_files={gcs}/data/train/*.txt", f"eval_files={gcs}/data/eval.txt",
                                "eval_interval=2", "eval_steps=2", out=runs))
    assert code == 0, err[-2000:]
    assert "eval step 4/4 | loss" in out
    code, _, err = finish(cli("steps=4", "dataset_type=text", "vocab_size=384", f"train_files={gcs}/none/*.txt",
                              out=tmp_path))
    assert (code, one_line(err)) == (2, f"config error: train_files: no file matches '{gcs}/none/*.txt'")
    step_dir = f"{runs}/tiny/checkpoints/4"
    exported = convert.maxtrain_to_hf(step_dir, f"{gcs}/hf")
    assert str(exported) == f"{gcs}/hf"
    convert.maxtrain_to_hf(step_dir, str(tmp_path / "hf"))
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert gs_files(f"{gcs}/hf") == [f"{gcs}/hf/{n}" for n in names]
    for n in names:
        assert storage.path(f"{gcs}/hf/{n}").read_bytes() == (tmp_path / "hf" / n).read_bytes(), n
    # A second export to the same place is refused before any work, in one line.
    capsys.readouterr()
    assert convert.main(["maxtrain_to_hf", "--checkpoint", step_dir, "--out", f"{gcs}/hf"]) == 2
    assert one_line(capsys.readouterr().err) == f"convert error: --out: {gcs}/hf already exists and is not empty"


@pytest.mark.slow
def test_generate_reads_a_checkpoint_on_gcs(gcs, tmp_path):
    """A run on gs:// (its profile trace uploaded there too), then generate from its checkpoint there."""
    code, _, err = finish(cli("steps=2", "checkpoint_period=2", "profiler=xplane", "profiler_start_step=1",
                              "profiler_steps=1", out=f"{gcs}/gen"))
    assert code == 0, err[-2000:]
    assert any(f.endswith(".xplane.pb") for f in gs_files(f"{gcs}/gen/tiny/profile/plugins/profile"))
    proc = subprocess.run([sys.executable, "-m", "maxtrain.generate", TINY,
                           f"load_parameters_path={gcs}/gen/tiny/checkpoints/2", "prompt_ids=1,2,3",
                           "max_new_tokens=4"], capture_output=True, text=True, timeout=300, cwd=TESTS.parent,
                          env=dict(os.environ, XLA_FLAGS=xla_flags(8)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    generated = [x for x in proc.stdout.splitlines() if x.startswith("generated ids: ")]
    assert len(generated) == 1 and len(json.loads(generated[0].removeprefix("generated ids: "))) == 4


@pytest.mark.slow
def test_every_format_and_prepared_shards_from_gcs(gcs, tiny_config, tmp_path):
    """Files on the bucket read as the same documents as local ones (text pieces by ranged reads); a corpus
    prepared onto the bucket holds the same shards, and reads the same rows, as one prepared locally."""
    import numpy as np
    import corpus
    from maxtrain.data import prepare as prepare_lib, sources
    from maxtrain.data.prepared import Corpus
    docs = corpus.paragraphs()[:30]
    for fmt in ("jsonl", "jsonl.gz", "parquet", "txt"):
        path = corpus.write(tmp_path / "d", docs, fmt)
        storage.path(f"{gcs}/fmt/{path.name}").write_bytes(path.read_bytes())
        pieces = sources.pieces([f"{gcs}/fmt/{path.name}"], "text", piece_bytes=1500)
        assert len(pieces) > 1 or fmt in ("jsonl.gz", "parquet")
        assert [d for p in pieces for d in sources.documents(p, "text")] == docs, fmt
    manifests = [prepare_lib.run(tiny_config(f"train_files={gcs}/fmt/*", f"prepared_dir={where}", "prepare_workers=2"),
                                 say=lambda *_: None) for where in (f"{gcs}/tok", str(tmp_path / "tok"))]
    assert manifests[0] == manifests[1] and manifests[0]["documents"] == 120
    remote, local = Corpus(f"{gcs}/tok"), Corpus(str(tmp_path / "tok"))
    for w in (0, 7, local.windows(32) - 1):
        for a, b in zip(remote.window(w, 32), local.window(w, 32)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_hf_import_from_gcs_equals_a_local_import(gcs, tmp_path):
    """--hf_dir on the bucket: the same parameters, bit for bit, as importing the same files from disk; the
    written config names the URL it came from."""
    import jax
    from helpers import load_maxtrain
    from test_convert import random_hf_model
    random_hf_model("llama-gqa").save_pretrained(tmp_path / "hf")
    storage.upload_tree(tmp_path / "hf", storage.path(f"{gcs}/hf_in"))
    remote = convert.hf_to_maxtrain(f"{gcs}/hf_in", str(tmp_path / "from_gcs"))
    local = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "from_disk"))
    assert f"from {gcs}/hf_in" in (remote / "maxtrain.yml").read_text().splitlines()[0]
    _, _, ours = load_maxtrain(remote / "maxtrain.yml")
    _, _, theirs = load_maxtrain(local / "maxtrain.yml")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), ours, theirs))
