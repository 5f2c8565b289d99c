"""The run says what it is doing: heartbeats in long phases, compile and save lines, step N/M with an ETA,
the start's record (printed, config.yml, starts.jsonl, metrics.jsonl, tensorboard), and an MFU that never
exceeds 100%."""

import json
import re
import subprocess
import sys
import time

import jax
import pytest
import yaml

from maxtrain.config import load as config
from maxtrain.observe import metrics, progress, run_record
from maxtrain.runtime import wording
from maxtrain.training import step as step_lib, evaluation
from conftest import TINY
from helpers import run_cli
from test_faults import CKPT
from test_faults_runtime import read_events


def test_durations_read_as_people_read_them():
    assert [wording.duration(s) for s in (0, 4.4, 59.6, 65, 3599, 3600, 7380)] == \
        ["0s", "4s", "59s", "1m 05s", "59m 59s", "1h 00m", "2h 03m"]


def test_a_heartbeat_beats_while_the_block_runs_and_stops_with_it(monkeypatch, capsys):
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.1)
    with progress.heartbeat("compiling the thing") as beat:
        time.sleep(0.35)
        beat.what = "saving the thing"
        time.sleep(0.25)
    out = capsys.readouterr().out.splitlines()
    time.sleep(0.3)
    assert capsys.readouterr().out == ""  # stopped with the block
    assert set(out) == {"still compiling the thing (0s)", "still saving the thing (0s)"}, out
    assert out.count("still compiling the thing (0s)") >= 2 and out[-1] == "still saving the thing (0s)"


def test_a_heartbeat_counts_from_when_the_phase_began(monkeypatch, capsys):
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.05)
    with progress.heartbeat("compiling", since=time.perf_counter() - 90):
        time.sleep(0.12)
    assert capsys.readouterr().out.splitlines()[0] == "still compiling (1m 30s)"


STEP_LINE = re.compile(r"step ([ \d]+)/(\d+) \| loss \d+\.\d{4} \| lr \S+ \| grad_norm \d+\.\d{3} \| \d+\.\d{3} s/step \| "
                       r"[\d,]+ tok/s \| \d+\.\d{3} TFLOP/s/dev \| MFU (\d+\.\d)%( \| ETA (\d+m )?\d+s)?")


def test_a_run_says_what_it_does(train_tiny, tmp_path, monkeypatch, capsys):
    """Start-up heartbeats while the step compiles, the compile line, step N/M and an ETA on every line
    after the first, and the saved line once each checkpoint is durable."""
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.1)
    compile_step = step_lib.Trainer.compile_train_step

    def slow_compile(self, lowered=None):  # a compile long enough for heartbeats
        time.sleep(0.5)
        return compile_step(self, lowered)
    monkeypatch.setattr(step_lib.Trainer, "compile_train_step", slow_compile)
    train_tiny(*CKPT, "steps=4", "checkpoint_period=2", "run_name=talk", n_devices=1)
    out = capsys.readouterr().out.splitlines()
    run = tmp_path / "talk"
    assert out[0].startswith("maxtrain: ")
    assert out[1] == run_record.line(json.loads((run / "starts.jsonl").read_text()))
    assert out[2].startswith("config: run_name=talk base_output_directory=") and \
        out[2].endswith(f"(the other keys as in base.yml; all in {run}/config.yml)")
    assert [line for line in out if not line.startswith("still ")][3] == \
        "compiling the train step (in the background while the state is made)"
    beats = [line for line in out if line.startswith("still ")]
    phase = re.compile(r"still (tracing the train step|initializing the state and compiling the train step|"
                       r"compiling the train step|"
                       rf"saving checkpoint [24]|reading the newest checkpoint in {run}/checkpoints|"
                       r"waiting for the last checkpoint to be written) \(\d+s\)")  # the last: on a loaded machine
    assert all(phase.fullmatch(line) for line in beats), beats
    assert any("compiling the train step" in line for line in beats), out  # the slow compile had its beats
    compiled = next(line for line in out if line.startswith("train step compiled in "))
    assert re.fullmatch(r"train step compiled in \d+\.\d s; state ready in \d+\.\d s", compiled)
    assert float(compiled.split()[4]) >= 0.5  # the compile's own time, measured on its thread
    assert out[out.index(compiled) + 1] == "MFU against peak_tflops_per_device=1 TFLOP/s"
    steps = [STEP_LINE.fullmatch(line) for line in out if line.startswith("step ")]
    assert all(steps) and [(m[1], m[2]) for m in steps] == [("1", "4"), ("2", "4"), ("3", "4"), ("4", "4")]
    assert steps[0][4] is None and all(m[4] for m in steps[1:])  # the first step (compile, warm-up) has no ETA
    assert steps[-1][4] == " | ETA 0s"
    saved = [line for line in out if line.startswith("saved checkpoint")]
    assert [s.split()[2] for s in saved] == ["2", "4"], out
    for s in saved:
        step = s.split()[2]
        assert re.fullmatch(rf"saved checkpoint {step} \(\d+\.\d s, {run}/checkpoints/{step}\)", s), s
    assert out.index(saved[-1]) < out.index(next(line for line in out if line.startswith("done: ")))


def test_an_eval_has_its_heartbeat_and_step_n_of_m(train_tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.1)
    evaluate = evaluation.evaluate

    def slow_evaluate(*args):
        time.sleep(0.35)
        return evaluate(*args)
    monkeypatch.setattr(evaluation, "evaluate", slow_evaluate)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog.\n\n" * 100)
    train_tiny("dataset_type=text", f"train_files={text}", "vocab_size=259", "eval_split_fraction=0.2", "eval_interval=2",
               "eval_steps=1", "steps=2", "run_name=evals", n_devices=1)
    out = capsys.readouterr().out.splitlines()
    assert "still evaluating at step 2/2 (0s)" in out, out
    line = next(line for line in out if line.startswith("eval "))
    assert re.fullmatch(r"eval step 2/2 \| loss \d+\.\d{4} \| perplexity \d+\.\d{3} \| [\d,]+ tokens \| \d+\.\d s"
                        r" \| ETA 0s", line), line


@pytest.mark.slow
def test_the_start_is_recorded_and_a_resume_appends_its_own_record(train_tiny, tmp_path, capsys):
    train_tiny(*CKPT, "steps=2", "run_name=rec", "metrics_backends=jsonl,tensorboard", n_devices=1)
    run = tmp_path / "rec"
    first_yml = (run / "config.yml").read_text()
    capsys.readouterr()
    train_tiny(*CKPT, "steps=3", "run_name=rec", "metrics_backends=jsonl,tensorboard", "log_period=3", n_devices=1)
    out = capsys.readouterr().out.splitlines()
    assert (run / "config.yml").read_text() == first_yml  # the first start's, kept
    assert yaml.safe_load(first_yml)["steps"] == 2 and yaml.safe_load(first_yml)["attention"] == "blockwise"
    assert f"note: this start's config differs from {run}/config.yml (the first start's): steps 2 -> 3, " \
           "log_period 1 -> 3, learning_rate_schedule_steps 2 -> 3" in out
    starts = [json.loads(line) for line in (run / "starts.jsonl").read_text().splitlines()]
    assert [s["start_step"] for s in starts] == [0, 2] and [s["config"]["steps"] for s in starts] == [2, 3]
    s = starts[1]
    assert s["versions"]["jax"] == jax.__version__ and s["versions"]["maxtrain"] == "0.1.0"
    assert s["devices"] == {"kind": jax.devices()[0].device_kind, "platform": "cpu", "count": 1, "processes": 1}
    assert s["output_directory"] == str(run) and s["argv"] == sys.argv and s["git"] == run_record.git_revision()
    assert s["config"]["attention"] == "blockwise"  # the platform default's choice, not "auto"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "start" in r) for r in rows] == [(0, True), (1, False), (2, False), (2, True), (3, False)]
    assert rows[0]["start"] == starts[0] and rows[3]["start"] == starts[1]
    texts = [(e.step, v.tensor.string_val[0].decode()) for f in sorted((run / "tensorboard").iterdir())
             for e in read_events(f) for v in e.summary.value if v.tag == "run/text_summary"]
    assert [step for step, _ in texts] == [0, 2]
    assert yaml.safe_load(texts[1][1].strip("`\n")) == json.loads(json.dumps(starts[1]))


def test_a_refused_resume_leaves_the_run_record_alone(train_tiny, tmp_path, capsys):
    from maxtrain.checkpoint import manager as checkpoint
    train_tiny(*CKPT, "steps=2", "run_name=kept", n_devices=1)
    run = tmp_path / "kept"
    before = {p: (run / p).read_text() for p in ("config.yml", "starts.jsonl", "metrics.jsonl")}
    with pytest.raises(checkpoint.CheckpointError):
        train_tiny(*CKPT, "steps=4", "run_name=kept", "base_mlp_dim=256", n_devices=1)
    assert {p: (run / p).read_text() for p in before} == before


def test_the_git_revision_is_this_checkouts_or_none(tmp_path, monkeypatch):
    revision = run_record.git_revision()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=run_record.PACKAGE_DIR, capture_output=True,
                          text=True).stdout.strip()
    assert revision is not None and revision.removesuffix("-dirty") == head[:12]
    assert revision in (head[:12], f"{head[:12]}-dirty")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.setattr(run_record, "PACKAGE_DIR", tmp_path / "venv" / "maxtrain")  # inside someone else's repo
    (tmp_path / "venv" / "maxtrain").mkdir(parents=True)
    assert run_record.git_revision() is None
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no git at all
    assert run_record.git_revision() is None


def test_command_line_reads_as_typed():
    assert run_record.command_line(["/x/maxtrain/train.py", "configs/base.yml", "run_name=a b"]) == \
        "python -m maxtrain.train configs/base.yml 'run_name=a b'"


# ---- MFU -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, peak", [
    ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0), ("TPU v5", 459.0), ("TPU v5p", 459.0),
    ("TPU v6 lite", 918.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA B200", 2250.0), ("NVIDIA L4", 121.0), ("NVIDIA L40S", None), ("cpu", None),
])
def test_nominal_peaks_by_device_kind(kind, peak):
    assert metrics.nominal_peak(kind) == peak


def test_mfu_is_at_most_one_and_a_rate_above_the_peak_raises_it_once():
    peak = metrics.Peak(2.0, "measured")
    assert peak.mfu(1.0) == (0.5, None)
    mfu, note = peak.mfu(3.0)
    assert mfu == 1.0 and note == ("note: the step ran at 3.000 TFLOP/s per device, above the measured peak of "
                                   "2.000: MFU is reported against the highest rate seen from now on")
    assert peak.mfu(2.5) == (2.5 / 3.0, None) and peak.mfu(4.0) == (1.0, None)  # said once


def test_an_accelerator_without_a_nominal_peak_reports_no_mfu(monkeypatch):
    class Unlisted:  # an accelerator the table lacks: a float32 matmul probe would not stand for its peak
        platform, device_kind = "gpu", "NVIDIA L40S"
    monkeypatch.setattr(metrics.jax, "devices", lambda: [Unlisted()])
    monkeypatch.setattr(metrics, "measure_cpu_peak_tflops", lambda **kw: pytest.fail("probed an accelerator"))
    c = config.load([TINY, "peak_tflops_per_device=0"])
    peak = metrics.peak_tflops_per_device(c)
    assert peak.mfu(123.0) == (None, None)
    assert peak.describe() == "no MFU: no nominal peak for NVIDIA L40S (peak_tflops_per_device=X sets one)"
    assert "MFU" not in metrics.format_line(5, 10, {"loss": 1.0, "learning_rate": 1e-3, "grad_norm": 1.0,
                                                    "step_seconds": 0.1, "tokens_per_second": 10.0,
                                                    "tflops_per_device": 1.0})


def test_a_cpu_probe_far_too_low_never_shows_mfu_over_100(train_tiny, tmp_path, monkeypatch, capsys):
    probes = []

    def low_probe(**kwargs):  # as if taken while the machine did something else
        probes.append(kwargs)
        return 1e-9
    monkeypatch.setattr(metrics, "measure_cpu_peak_tflops", low_probe)
    train_tiny("peak_tflops_per_device=0", "steps=3", "run_name=mfu", n_devices=1)
    out = capsys.readouterr().out.splitlines()
    assert probes == [{"probes": metrics.CPU_PROBES}]
    local = jax.local_device_count()
    assert (f"MFU against a measured CPU peak of {1e-9 / local:.3f} TFLOP/s per device (best of 3 matmul probes, "
            f"shared by {local} devices; peak_tflops_per_device=X sets it)") in out
    notes = [line for line in out if line.startswith("note: the step ran at ")]
    assert len(notes) == 1 and notes[0].endswith("above the measured peak of 0.000: MFU is reported against the "
                                                 "highest rate seen from now on")
    mfus = [float(STEP_LINE.fullmatch(line)[3]) for line in out if line.startswith("step ")]
    assert len(mfus) == 3 and max(mfus) <= 100.0 and mfus[0] == 100.0
    rows = [json.loads(line) for line in (tmp_path / "mfu" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/mfu"] <= 1.0 for r in rows if "start" not in r)


# ---- maxtrain.compile ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_compile_prints_its_phases(tmp_path):
    code, out, err, _ = run_cli(TINY, "compile_topology=v5e-4", out=tmp_path, module="maxtrain.compile")
    assert code == 0, err[-2000:]
    lines = out.splitlines()
    assert lines[0] == "building the model and its shardings for v5e-4 (4 devices)"
    assert lines[1] == "lowering the train step (tracing it to XLA)"
    assert re.fullmatch(r"compiling the train step for v5e-4 \(lowered in \d+\.\d s\)", lines[2])
    assert re.fullmatch(r"compiled in \d+\.\d s; reading XLA's memory analysis", lines[3])
    assert lines[-1].startswith("fits: ")
