"""metrics_backends: tensorboard, jsonl and wandb, each optional and imported only when named."""

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from maxtrain.observe import writers as metric_writers
from conftest import TINY
from helpers import main_in_process, one_line


@pytest.mark.parametrize("override, expected", [
    ("enable_tensorboard=false", "config error: enable_tensorboard: replaced by metrics_backends (default "
                                 "tensorboard,jsonl; metrics_backends=jsonl writes no tensorboard events)"),
    ("metrics_backends=jsonl,mlflow", "config error: metrics_backends: 'mlflow' is not one of tensorboard, jsonl, "
                                      "wandb"),
    ("metrics_backends=jsonl,jsonl", "config error: metrics_backends: 'jsonl' is named twice"),
])
def test_bad_backends_are_one_line(override, expected, capsys, tmp_path):
    code, err = main_in_process([TINY, f"base_output_directory={tmp_path}", override], capsys)
    assert code == 2 and one_line(err) == expected


def test_a_missing_wandb_is_one_line_naming_the_extra(capsys, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    code, err = main_in_process([TINY, f"base_output_directory={tmp_path}", "metrics_backends=jsonl, wandb"], capsys)
    assert code == 2 and one_line(err) == ('config error: metrics_backends: wandb is not installed: pip install -e '
                                           '".[wandb]" (or remove wandb from metrics_backends)')
    assert not (tmp_path / "tiny").exists()  # refused before anything was made


@pytest.mark.slow
@pytest.mark.parametrize("backends, files", [
    ("jsonl", {"metrics.jsonl"}),
    ("tensorboard", {"tensorboard"}),
    ("tensorboard,jsonl", {"metrics.jsonl", "tensorboard"}),
    ("", set()),
])
def test_each_backend_writes_only_its_files(backends, files, train_tiny, tmp_path):
    train_tiny(f"metrics_backends={backends}", "steps=2", n_devices=1)
    # the run's records, whatever the backends: its config, its starts, its goodput ledger
    written = {p.name for p in (tmp_path / "tiny").iterdir()} - {"config.yml", "starts.jsonl", "goodput.jsonl"}
    assert written == files


def test_backends_load_lazily():
    # Neither tensorboardX nor wandb is imported by a run that does not name it.
    code = ("import sys; from maxtrain import train; from maxtrain.observe import writers as metric_writers; "
            "print(sorted(m for m in ('tensorboardX', 'wandb') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def wandb_records(path: Path) -> list:
    """Every record of a W&B transaction log (.wandb): W&B's leveldb-style log of 32 KiB blocks, each record a
    7-byte header (CRC32, length, type: 1 full, 2 first, 3 middle, 4 last) and a protobuf Record."""
    from wandb.proto import wandb_internal_pb2
    data, block, pos, records, part = path.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B"  # W&B's file header, 7 bytes
    while pos < len(data):
        left = block - pos % block
        if left < 7:  # too little of the block left for a header: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


@pytest.mark.slow
def test_wandb_offline_holds_the_step_metrics(train_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    result = train_tiny("metrics_backends=jsonl,wandb", "steps=3", "run_name=wb", n_devices=1)
    run = tmp_path / "wb"
    logs = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1, list((run / "wandb").rglob("*"))
    kept = (run / "wandb_id").read_text().strip()  # made at the first start: a resume continues this W&B run
    assert kept.startswith("wb-") and logs[0].parent.name.endswith(kept)
    history = {}
    config = None
    for r in wandb_records(logs[0]):
        if r.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = items
        if r.WhichOneof("record_type") == "run" and r.run.config.update:
            config = {u.key: json.loads(u.value_json) for u in r.run.config.update}
    assert sorted(history) == [1, 2, 3]
    assert [history[s]["train/loss"] for s in (1, 2, 3)] == pytest.approx(result["losses"], rel=1e-6)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [history[r["step"]]["train/grad_norm"] for r in rows if "start" not in r] == \
        pytest.approx([r["train/grad_norm"] for r in rows if "start" not in r], rel=1e-6)
    assert config["steps"] == 3 and config["run_name"] == "wb"
    assert config["maxtrain"]["output_directory"] == str(run) and config["maxtrain"]["devices"]["count"] == 1


def test_wandb_writes_from_process_0_only(tmp_path, monkeypatch):
    monkeypatch.setattr(metric_writers.jax, "process_index", lambda: 1)
    w = metric_writers.MetricsWriter(tmp_path / "run", ("jsonl", "tensorboard", "wandb"), record={"config": {}})
    w.write(1, {"loss": 1.0})
    w.close()
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_failed_run_closes_its_writers_and_puts_its_signal_handlers_back(tmp_path, monkeypatch, capsys):
    """A run that stops for cause (a non-finite step under nan_policy=stop) ends its W&B run marked failed with
    the steps it logged, and leaves the caller's Ctrl-C and SIGTERM handlers as they were."""
    import signal
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    code, err = main_in_process([TINY, f"base_output_directory={tmp_path}", "run_name=bad", "learning_rate=1e6",
                                 "nan_policy=stop", "log_period=1", "steps=20", "metrics_backends=jsonl,wandb"], capsys)
    assert code == 1 and one_line(err).startswith("run error: step "), err
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    logs = list((tmp_path / "bad" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    records = wandb_records(logs[0])
    logged = [r for r in records if r.WhichOneof("record_type") == "history"]
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    assert len(logged) >= 1 and exits == [1]
