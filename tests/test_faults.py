"""Fault injection: bad input, divergence, damaged checkpoints, full and read-only disks, early SIGTERM.

Every failure must be one line with a non-zero exit code (2: the input, 1: the run), within a bounded
time, and must never cost the last good checkpoint.
"""

import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from maxtrain.data import pipeline as data
from maxtrain import train
from conftest import TINY, TESTS, tmpfs
from helpers import main_in_process, one_line, run_cli, saved_arrays

CKPT = ("enable_checkpointing=true",)


# ---- bad values and files: exit 2, one line naming the key or file ---------------------------------

@pytest.mark.parametrize("override, expected", [
    ("learning_rate=nan", "config error: learning_rate: must be a finite number"),
    ("learning_rate=inf", "config error: learning_rate: must be a finite number"),
    ("gradient_clipping_threshold=nan", "config error: gradient_clipping_threshold: must be a finite number"),
    ("per_device_batch_size=nan", "config error: per_device_batch_size: must be a finite number"),
    ("per_device_batch_size=inf", "config error: per_device_batch_size: must be a finite number"),
    ("steps=1000000000000", "config error: steps: 1000000000000 is out of range"),
    ("run_name=..", "config error: run_name: '..' is not a plain name"),
    ("run_name=a/../../b", "config error: run_name:"),
    ("nan_policy=ignore", "config error: nan_policy: 'ignore' is not one of skip, stop, rollback"),
])
def test_bad_values_are_one_line(override, expected, capsys, tmp_path):
    code, err = main_in_process([TINY, f"base_output_directory={tmp_path}", override], capsys)
    assert code == 2 and one_line(err).startswith(expected), err


def test_binary_config_and_help(capsys, tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    code, err = main_in_process([str(binary)], capsys)
    assert code == 2 and one_line(err) == f"config error: config: {binary} is not a YAML text file"
    assert train.main(["--help"]) == 0 and "usage: python -m maxtrain.train" in capsys.readouterr().out
    assert train.main([]) == 2 and "usage:" in capsys.readouterr().err


def test_unwritable_output_directory(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    code, err = main_in_process([TINY, f"base_output_directory={blocker}/out"], capsys)
    assert code == 2 and one_line(err).startswith("config error: base_output_directory: cannot write"), err


def write_array_record(path: Path, records: list[bytes]) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        writer.write(r)
    writer.close()


@pytest.mark.slow
def test_bad_data_files_name_the_file(capsys, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "num.jsonl").write_text('{"text": "fine"}\n{"text": 42}\n')
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "num.parquet")
    write_array_record(tmp_path / "bin.array_record", [b"\xff\xfe\xfd not utf-8"] * 40)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "letters.txt").write_text("\n\n".join("abcdefgh"))  # one token per document
    (tmp_path / "short.txt").write_text("a few words only")
    cases = [
        (["dataset_type=text", f"train_files={tmp_path}/num.jsonl"],
         f"data error: {tmp_path}/num.jsonl: line 2: field 'text' is int, not text"),
        (["dataset_type=parquet", f"train_files={tmp_path}/num.parquet"],
         f"data error: {tmp_path}/num.parquet: column 'text' (text_field) holds int64, not text"),
        (["dataset_type=array_record", f"train_files={tmp_path}/bin.array_record"],
         f"data error: {tmp_path}/bin.array_record: record 0 is not UTF-8 text"),
        (["dataset_type=text", f"train_files={tmp_path}/empty.txt"],
         f"data error: {tmp_path}/empty.txt: no document has two tokens or more"),
        (["dataset_type=text", f"train_files={tmp_path}/letters.txt", "add_bos=false", "add_eos=false"],
         f"data error: {tmp_path}/letters.txt: no document has two tokens or more (add_bos=False, add_eos=False)"),
        (["dataset_type=text", f"train_files={tmp_path}/short.txt", "num_epochs=1"],
         f"data error: {tmp_path}/short.txt: the data ends before the first batch"),
    ]
    for overrides, expected in cases:
        t0 = time.perf_counter()
        code, err = main_in_process([TINY, f"base_output_directory={tmp_path}", "vocab_size=384", *overrides], capsys)
        assert code == 2 and one_line(err).startswith(expected), (overrides, err)
        assert time.perf_counter() - t0 < 60  # no search without end
        assert not (tmp_path / "tiny").exists(), overrides  # the start's own record does not keep its directory


@pytest.mark.slow
@pytest.mark.parametrize("override, needs", [("vocab_size=100000000", "the train state needs"),
                                             ("vocab_size=10000000", "initializing the state needs"),
                                             ("per_device_batch_size=100000", "the train step needs")])
def test_sizes_that_cannot_fit_are_refused_before_they_run(override, needs, tmp_path):
    code, out, err, seconds = run_cli(TINY, override, out=tmp_path, timeout=120)
    line = one_line(err)
    assert code == 2 and line.startswith(f"memory error: {needs}") and "GiB per device" in line, err[-2000:]
    assert seconds < 60


# ---- non-finite steps ---------------------------------------------------------------------------

def strict_rows(path: Path) -> list[dict]:
    def refuse(constant):
        raise ValueError(f"non-JSON constant {constant}")
    rows = [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]
    return [r for r in rows if "start" not in r]  # the steps' rows, not each start's record


def finite_checkpoints(run_dir: Path) -> list[int]:
    """Steps on disk; asserts every array in each is finite."""
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    for step in steps:
        for x in jax.tree.leaves(saved_arrays(run_dir / "checkpoints" / str(step) / "state")):
            assert np.all(np.isfinite(np.asarray(x, np.float32))), f"step {step} holds non-finite values"
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "stop", "rollback"])
def test_a_divergent_run_stops_without_a_nan_checkpoint(policy, tmp_path):
    code, out, err, seconds = run_cli(TINY, *CKPT, "learning_rate=1e6", "gradient_clipping_threshold=0", "steps=20",
                                      "checkpoint_period=5", f"nan_policy={policy}", "max_nonfinite_steps=3",
                                      out=tmp_path)
    line = one_line(err)
    assert code == 1 and line.startswith("run error: step "), err[-2000:]
    assert ("nan_policy=stop" in line) if policy == "stop" else ("more than max_nonfinite_steps=3" in line)
    finite_checkpoints(tmp_path / "tiny")
    rows = strict_rows(tmp_path / "tiny" / "metrics.jsonl")
    bad = [r for r in rows if r["train/nonfinite"]]
    assert bad and any(r["train/grad_norm"] is None for r in bad)


class Poisoned:
    """The synthetic stream with NaN weights in the batches numbered `bad` (0-based): a data spike."""

    def __init__(self, inner, bad):
        self.inner, self.bad = inner, set(bad)

    def __iter__(self):
        return self

    def __next__(self):
        index = self.inner.step
        batch = next(self.inner)
        if index in self.bad:
            w = batch["weights"]
            batch = {**batch, "weights": jax.device_put(np.full(w.shape, np.nan, np.float32), w.sharding)}
        return batch

    def __getattr__(self, name):  # get_state, set_state, skip
        return getattr(self.inner, name)


class Skipping(Poisoned):
    """The synthetic stream without the batches numbered `bad`, from the start."""

    def __next__(self):
        while self.inner.step in self.bad:
            self.inner.skip(1)
        return next(self.inner)


def stream(monkeypatch, wrapper, bad):
    make = data.make_iterators
    monkeypatch.setattr(data, "make_iterators", lambda c, sharding, *_: (wrapper(make(c, sharding)[0], bad), None))


@pytest.mark.slow
def test_rollback_equals_a_run_that_skipped_those_batches(train_tiny, tmp_path, monkeypatch, capsys):
    # Checkpoints at 4 and 8; batch 6 (step 7) is poisoned. The rollback restores step 4 and skips the
    # batches of steps 5-7 (4, 5, 6): from then on it must be the run that never saw them.
    args = (*CKPT, "steps=12", "checkpoint_period=4", "nan_policy=rollback", "learning_rate_schedule_steps=12")
    stream(monkeypatch, Poisoned, [6])
    rolled = train_tiny(*args, "run_name=rolled")
    assert "rollback: step 7 was not finite" in capsys.readouterr().out
    stream(monkeypatch, Skipping, [4, 5, 6])
    reference = train_tiny(*args, "run_name=reference")
    assert len(rolled["losses"]) == 12 and all(math.isfinite(x) for x in rolled["losses"])
    assert rolled["losses"] == reference["losses"]  # identical, not close
    assert finite_checkpoints(tmp_path / "rolled") == [4, 8, 12]
    # The metrics file holds each step once, in order, valid JSON.
    assert [r["step"] for r in strict_rows(tmp_path / "rolled" / "metrics.jsonl")] == list(range(1, 13))
    # And the run resumes from its last checkpoint like any other.
    monkeypatch.undo()
    resumed = train_tiny(*args, "run_name=rolled", "steps=13", "learning_rate_schedule_steps=12")
    assert len(resumed["losses"]) == 1 and math.isfinite(resumed["losses"][0])


def test_skip_drops_the_update_and_goes_on(train_tiny, tmp_path, monkeypatch):
    stream(monkeypatch, Poisoned, [2])
    out = train_tiny(*CKPT, "steps=6", "checkpoint_period=3", "run_name=skipped")
    assert out["nonfinite_steps"] == 1 and math.isnan(out["losses"][2])
    assert all(math.isfinite(x) for i, x in enumerate(out["losses"]) if i != 2)
    assert finite_checkpoints(tmp_path / "skipped") == [3, 6]
    rows = strict_rows(tmp_path / "skipped" / "metrics.jsonl")
    assert rows[2]["train/loss"] is None and rows[2]["train/nonfinite"] == 1.0 and rows[5]["train/nonfinite_steps"] == 1


@pytest.mark.slow
def test_stop_saves_nothing_after_the_bad_step_and_resumes(train_tiny, tmp_path, monkeypatch, capsys):
    # Step 5 is the first step on checkpoint 4's parameters and it is not finite: 4 is never trusted, so
    # the resume starts from 2 and keeps 4 aside, named in one line.
    from maxtrain.runtime.errors import RunError
    stream(monkeypatch, Poisoned, [4])
    with pytest.raises(RunError, match="step 5: the loss or gradients are not finite.*last trusted checkpoint: step 2"):
        train_tiny(*CKPT, "steps=8", "checkpoint_period=2", "nan_policy=stop", "run_name=stopped")
    assert finite_checkpoints(tmp_path / "stopped") == [2, 4]
    monkeypatch.undo()
    capsys.readouterr()
    resumed = train_tiny(*CKPT, "steps=8", "checkpoint_period=2", "nan_policy=stop", "run_name=stopped")
    out = capsys.readouterr().out
    assert "checkpoint 4 in" in out and "is not trusted (step 4: step 5, the first on its parameters, was not " \
        "finite); resuming from step 2 instead (kept aside as 4.untrusted)" in out, out
    assert len(resumed["losses"]) == 6 and all(math.isfinite(x) for x in resumed["losses"])
    assert (tmp_path / "stopped" / "checkpoints" / "4.untrusted" / "state").is_dir()


@pytest.mark.parametrize("policy, saved", [("skip", [2, 6]), ("rollback", [2, 4, 6])])
def test_a_state_overflowed_by_a_finite_update_is_never_saved(policy, saved, train_tiny, tmp_path, monkeypatch):
    # Finite gradients can still overflow the parameters; the save's digest finds it and the step
    # counts as non-finite (here faked once, at the save of step 4).
    from maxtrain.checkpoint import manager as ckpt_lib
    real, calls = ckpt_lib.digest, []

    def digest_overflowed_at_4(state, *args):
        entries, finite = real(state, *args)
        calls.append(int(state.step))
        return entries, finite and not (calls[-1] == 4 and calls.count(4) == 1)
    monkeypatch.setattr(ckpt_lib, "digest", digest_overflowed_at_4)
    out = train_tiny(*CKPT, "steps=6", "checkpoint_period=2", f"nan_policy={policy}", f"run_name={policy}")
    assert out["nonfinite_steps"] == 1 and int(out["state"].step) == 6
    assert finite_checkpoints(tmp_path / policy) == saved


# ---- damaged checkpoints: fall back to the newest good step ------------------------------------

def largest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_bytes(path: Path, n: int = 64) -> None:
    b = bytearray(path.read_bytes())
    middle = len(b) // 2
    for i in range(middle, middle + n):
        b[i] ^= 0xFF
    path.write_bytes(bytes(b))


def damage(kind: str, step_dir: Path) -> None:
    if kind == "bit flips":
        flip_bytes(largest_file(step_dir))
    elif kind == "truncated file":
        f = largest_file(step_dir)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif kind == "empty directory":
        shutil.rmtree(step_dir)
        step_dir.mkdir()
    elif kind == "garbage model description":
        for f in (step_dir / "model").rglob("*"):
            if f.is_file():
                f.write_bytes(b"\x00garbage{{")


@pytest.mark.slow
# A missing file and an empty step directory: every_array_file_damaged's "deleted" and no_usable_step below.
@pytest.mark.parametrize("kind", ["bit flips", "truncated file", "garbage model description"])
def test_a_damaged_latest_step_falls_back_to_the_previous(kind, train_tiny, tmp_path, capsys):
    args = (*CKPT, "checkpoint_period=5", "learning_rate_schedule_steps=15")
    train_tiny(*args, "run_name=damaged", "steps=10")
    ckpts = tmp_path / "damaged" / "checkpoints"
    shutil.copytree(tmp_path / "damaged", tmp_path / "clean")
    shutil.rmtree(tmp_path / "clean" / "checkpoints" / "10")  # the same run, resumed from step 5
    damage(kind, ckpts / "10")
    capsys.readouterr()
    resumed = train_tiny(*args, "run_name=damaged", "steps=15")
    out = capsys.readouterr().out
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"{ckpts}/10 is unusable" in warning[0] and "resuming from step 5" in warning[0]
    assert f"resumed from {ckpts}/5" in out
    assert (ckpts / "10.unusable").is_dir()  # moved aside, never deleted
    reference = train_tiny(*args, "run_name=clean", "steps=15")
    assert resumed["losses"] == reference["losses"] and len(resumed["losses"]) == 10


@pytest.mark.slow
def test_every_array_file_damaged_falls_back_without_noise(tmp_path):
    # Many of Orbax's read coroutines fail at once; the restore reports one and the others' errors, never
    # retrieved, must not reach the terminal (asyncio and the unraisable hook printed them, 60+ lines).
    # Every other file deleted, the rest truncated: both kinds of failure at once.
    run = (TINY, *CKPT, "checkpoint_period=5", "learning_rate_schedule_steps=15")
    code, out, err, _ = run_cli(*run, "steps=10", out=tmp_path)
    assert code == 0, err[-2000:]
    for i, f in enumerate(sorted((tmp_path / "tiny" / "checkpoints" / "10" / "state").rglob("d/*"))):
        f.unlink() if i % 2 == 0 else f.write_bytes(f.read_bytes()[:10])
    code, out, err, seconds = run_cli(*run, "steps=12", out=tmp_path)
    assert code == 0 and err == "" and seconds < 120, err[-3000:]
    assert "10 is unusable" in out and "resumed from" in out and "/checkpoints/5" in out


@pytest.mark.slow
def test_no_usable_step_is_one_line(train_tiny, tmp_path, capsys):
    train_tiny(*CKPT, "run_name=ruined", "steps=4", "checkpoint_period=2")
    for step in ("2", "4"):
        damage("empty directory", tmp_path / "ruined" / "checkpoints" / step)
    code, err = main_in_process([TINY, f"base_output_directory={tmp_path}", *CKPT, "run_name=ruined", "steps=6"],
                                capsys)
    line = one_line(err)
    assert code == 2 and "no usable checkpoint" in line and "step 4:" in line and "step 2:" in line


@pytest.mark.slow
def test_resuming_with_another_optimizer_dtype_is_refused(train_tiny, tmp_path, capsys):
    train_tiny(*CKPT, "run_name=dtype", "steps=2")
    saved_config = (tmp_path / "dtype" / "config.yml").read_bytes()
    code, err = main_in_process([TINY, f"base_output_directory={tmp_path}", *CKPT, "run_name=dtype", "steps=4",
                                 "mu_dtype=bfloat16"], capsys)
    line = one_line(err)
    assert code == 2 and "cannot resume this run with this config" in line and "mu" in line and "float32" in line
    assert (tmp_path / "dtype" / "config.yml").read_bytes() == saved_config  # the refused config is not kept


@pytest.mark.slow
@pytest.mark.parametrize("override, expected", [
    ("load_parameters_path={tmp}/nowhere", "checkpoint error: load_parameters_path: "),
    ("load_full_state_path={tmp}/dtype/checkpoints/2", "checkpoint error: load_full_state_path: "),
])
def test_a_start_that_fails_at_load_leaves_no_run_directory(override, expected, train_tiny, tmp_path, capsys):
    train_tiny(*CKPT, "run_name=dtype", "steps=2")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = main_in_process([TINY, f"base_output_directory={tmp_path}", *CKPT, "run_name=fresh", "mu_dtype=bfloat16",
                                 override.format(tmp=tmp_path)], capsys)
    assert code == 2 and one_line(err).startswith(expected), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ---- trusted checkpoints: a finite blow-up never costs the last one that worked ------------------

@pytest.mark.slow
def test_a_finite_blow_up_never_costs_the_last_trusted_checkpoint(tmp_path):
    # A healthy run saves 6, 8, 10 (keep 3). Resumed with learning_rate=1e30, step 11's update is finite
    # but blows the parameters up; every later step is non-finite and skipped, and the saves 12, 14, ...
    # hold that finite, broken state. Checkpoint 10 was seen to work (step 11 was finite): it must stay.
    run = (TINY, *CKPT, "checkpoint_period=2", "max_num_checkpoints_to_keep=3", "learning_rate_schedule_steps=30")
    code, out, err, _ = run_cli(*run, "steps=10", out=tmp_path)
    assert code == 0, err[-2000:]
    code, out, err, seconds = run_cli(*run, "steps=30", "learning_rate=1e30", out=tmp_path)
    line = one_line(err)
    assert code == 1 and seconds < 120, err[-2000:]
    assert line.startswith("run error: step 22: 11 non-finite steps, more than max_nonfinite_steps=10 "
                           "(nan_policy=skip)") and line.endswith(
        f"last trusted checkpoint: step 10 in {tmp_path.absolute() / 'tiny' / 'checkpoints'}"), line
    ckpts = tmp_path / "tiny" / "checkpoints"
    assert finite_checkpoints(tmp_path / "tiny") == [10, 16, 18, 20]  # retention kept 10 beside the newest 3
    trust = json.loads((ckpts / "trust.json").read_text())
    assert trust["trusted"] == [10] and sorted(trust["rejected"]) == ["16", "18", "20"]
    # Loading a rejected step on purpose works, with one warning line saying so.
    code, out, err, _ = run_cli("maxtrain_to_hf", "--checkpoint", str(ckpts / "20"), "--out", str(tmp_path / "hf"),
                                module="maxtrain.convert")
    assert code == 0 and f"warning: {ckpts.absolute() / '20'} is not trusted (step 21, the first on its " \
        "parameters, was not finite)" in out, out + err[-2000:]
    # The rerun with a sane learning rate resumes from 10, naming the steps it keeps aside in one line.
    code, out, err, _ = run_cli(*run, "steps=12", out=tmp_path)
    assert code == 0 and not err.strip(), err[-2000:]
    aside = [x for x in out.splitlines() if "not trusted" in x]
    assert len(aside) == 1 and aside[0].startswith(f"warning: checkpoints 16, 18, 20 in {ckpts.absolute()} are not "
                                                   "trusted") and "resuming from step 10 instead" in aside[0], out
    assert f"resumed from {ckpts.absolute()}/10" in out
    assert sorted(p.name for p in ckpts.iterdir()) == ["10", "12", "16.untrusted", "18.untrusted", "20.untrusted",
                                                       "trust.json"]


@pytest.mark.slow
def test_rollback_restores_the_newest_trusted_step(train_tiny, tmp_path, monkeypatch, capsys):
    # Saves at 2, 4, 6; batch 6 (step 7, the first on checkpoint 6's parameters) is poisoned. Checkpoint 6
    # is not trusted, so the rollback goes back to 4 and skips the batches of steps 5-7.
    stream(monkeypatch, Poisoned, [6])
    out = train_tiny(*CKPT, "steps=9", "checkpoint_period=2", "nan_policy=rollback", "run_name=rb")
    printed = capsys.readouterr().out
    assert "warning: checkpoint 6 is not trusted: step 7, the first on its parameters, was not finite" in printed
    assert "is not trusted (step 6: step 7, the first on its parameters, was not finite); resuming from step 4" \
        in printed and "rollback: step 7 was not finite (1 of max_nonfinite_steps=10); back at step 4, skipping " \
        "the 3 batches after it" in printed, printed
    assert int(out["state"].step) == 9 and all(math.isfinite(x) for x in out["losses"])
    assert (tmp_path / "rb" / "checkpoints" / "6.untrusted").is_dir()


def test_trust_verdicts_spikes_and_their_file(tmp_path, capsys):
    from maxtrain.checkpoint.trust import Trust
    t = Trust(tmp_path, spike_factor=3.0)
    for step, loss in enumerate([9.0, 8.0, 7.0, 6.0], start=1):
        assert t.observe(step, loss, True) is None  # nothing saved yet: nothing judged
    t.saved(4)
    assert t.verdict(4) == "pending"
    assert t.observe(5, 5.5, True) is None and t.verdict(4) == "trusted"
    t.saved(6)
    t.observe(6, 5.0, True)  # the step saved, not the first on its parameters
    why = t.observe(7, 30.0, True)  # over 3 x the median of the recent losses: a spike
    assert t.verdict(6) == "rejected" and "step 7's loss 30 was a spike, over loss_spike_factor=3" in why
    t.saved(8)
    assert "was not finite" in t.observe(9, float("nan"), False) and t.verdict(8) == "rejected"
    t.saved(10)  # pending: its first step has not been read
    # The verdicts and the recent losses survive a restart; a new save of a step number clears its verdict.
    again = Trust(tmp_path, spike_factor=3.0)
    assert [again.verdict(s) for s in (4, 6, 8, 10)] == ["trusted", "rejected", "rejected", "pending"]
    assert again.newest_trusted([4, 6, 8, 10]) == 4 and again.losses[-1] == 30.0
    again.saved(6)
    assert again.verdict(6) == "pending"
    # Without a spike test, or with too few losses known, any finite step trusts its checkpoint.
    off = Trust(tmp_path / "off", spike_factor=0)
    (tmp_path / "off").mkdir()
    off.saved(1)
    assert off.observe(2, 1e6, True) is None and off.verdict(1) == "trusted"
    # An unreadable file: one warning, and every step is pending again (never trusted by accident).
    (tmp_path / "trust.json").write_text("{not json")
    broken = Trust(tmp_path, spike_factor=3.0)
    assert broken.verdict(4) == "pending" and "trust.json is unreadable" in capsys.readouterr().out


# ---- full and read-only disks -------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (about two tiny checkpoints), where this machine lets the tests mount one."""
    with tmpfs(tmp_path / "disk", "size=3m") as mount:
        yield mount


def steps_on(ckpts: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_disk_full_is_one_line_and_keeps_the_last_good_checkpoint(small_disk, tmp_path):
    args = (TINY, *CKPT, "steps=40", "checkpoint_period=2", "max_num_checkpoints_to_keep=0",
            "learning_rate_schedule_steps=40")
    code, out, err, seconds = run_cli(*args, out=small_disk, timeout=180)
    line = one_line(err)
    # The disk fills during a step's save or while its verdicts (trust.json) are rewritten: by timing.
    assert code == 1 and line.startswith(("checkpoint error: saving step ",
                                          "checkpoint error: writing the checkpoints' verdicts to ")), err
    assert "No space left on device" in line, err
    assert seconds < 120
    good = steps_on(small_disk / "tiny" / "checkpoints")
    assert good and f"the last good checkpoint is step {good[-1]}" in line
    # Off the full disk, the last good step restores bitwise: it equals a straight run to that step.
    shutil.copytree(small_disk / "tiny", tmp_path / "moved" / "tiny")
    code, out, err, _ = run_cli(*args[:-3], f"steps={good[-1]}", "learning_rate_schedule_steps=40",
                                "run_name=straight", out=tmp_path / "moved")
    assert code == 0, err[-2000:]
    from test_checkpoint import params_equal_bitwise, saved_params
    assert params_equal_bitwise(saved_params(tmp_path / "moved" / "tiny" / "checkpoints" / str(good[-1])),
                                saved_params(tmp_path / "moved" / "straight" / "checkpoints" / str(good[-1])))


@pytest.mark.slow
def test_verdicts_that_cannot_be_written_stop_the_run_naming_the_last_good_checkpoint(train_tiny, tmp_path):
    from maxtrain.checkpoint.manager import SaveError
    train_tiny(*CKPT, "steps=2", "checkpoint_period=2")
    verdicts = tmp_path / "tiny" / "checkpoints" / "trust.json"
    verdicts.unlink()
    (verdicts / "in_the_way").mkdir(parents=True)  # the rewrite of trust.json fails: it is a directory
    with pytest.raises(SaveError) as raised:  # step 3 judges checkpoint 2 and cannot record it
        train_tiny(*CKPT, "steps=4", "checkpoint_period=2")
    assert str(raised.value) == (f"writing the checkpoints' verdicts to {verdicts} failed: Is a directory [errno 21]; "
                                 f"the last good checkpoint is step 2 in {verdicts.parent}")
    assert steps_on(verdicts.parent) == [2] and not verdicts.with_name("trust.json.tmp").exists()


@pytest.mark.slow
def test_read_only_checkpoints_are_one_line_and_exit(small_disk):
    code, _, err, _ = run_cli(TINY, *CKPT, "steps=2", out=small_disk)
    assert code == 0, err[-2000:]
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    code, out, err, seconds = run_cli(TINY, *CKPT, "steps=4", out=small_disk, timeout=120)
    line = one_line(err)
    assert code != 0 and "Read-only file system" in line, err[-2000:]
    assert seconds < 60 and steps_on(small_disk / "tiny" / "checkpoints") == [2]


# ---- SIGTERM from the first moment; MFU without save time ---------------------------------------

@pytest.mark.slow
def test_sigterm_during_start_up_exits_cleanly(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "maxtrain.train", TINY, f"base_output_directory={tmp_path}",
                             *CKPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=TESTS.parent)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "stopped by SIGTERM during start-up" in out, (out, err[-2000:])
    assert "Traceback" not in err


@pytest.mark.slow
def test_step_time_excludes_checkpoint_saves(train_tiny, tmp_path, monkeypatch):
    from maxtrain.checkpoint import manager as ckpt_lib
    save = ckpt_lib.Checkpointer.save

    def slow_save(self, *args, **kwargs):  # a save that takes 2 s of the loop's time
        save(self, *args, **kwargs)
        time.sleep(2.0)
    monkeypatch.setattr(ckpt_lib.Checkpointer, "save", slow_save)
    train_tiny(*CKPT, "steps=6", "checkpoint_period=2", "run_name=timed")
    rows = strict_rows(tmp_path / "timed" / "metrics.jsonl")
    assert max(r["train/step_seconds"] for r in rows[1:]) < 1.5, [r["train/step_seconds"] for r in rows]


# ---- the same faults in a two-process job: every process decides alike, none hangs ---------------

@pytest.mark.slow
def test_two_processes_roll_back_together(tmp_path):
    from test_multiprocess import launch
    mesh = ("ici_fsdp_parallelism=4", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2")
    proc = launch(tmp_path, *CKPT, *mesh, "run_name=div", "learning_rate=1e6", "gradient_clipping_threshold=0",
                  "steps=20", "checkpoint_period=2", "nan_policy=rollback", "max_nonfinite_steps=2", timeout=300)
    assert proc.returncode == 1 and "more than max_nonfinite_steps=2" in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.count("rollback: step") == 2
    assert "more than max_nonfinite_steps=2" in (tmp_path / "logs" / "process_1.log").read_text()
    finite_checkpoints(tmp_path / "div")
    # A damaged step in a two-process job: the next test.


@pytest.mark.slow
def test_a_file_only_one_process_reads_damaged_falls_back_on_both(tmp_path):
    """Each process reads its own shards: a damaged file of one process's fails a read inside Orbax's restore
    on one process alone (which one depends on the layout), while the other waits in the barrier that ends
    the restore. Both agree on that and fall back together: past step 6 (process 0's file damaged) and step 4
    (process 1's) to step 2."""
    from test_multiprocess import launch
    mesh = ("ici_fsdp_parallelism=4", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2")
    proc = launch(tmp_path, *CKPT, *mesh, "run_name=one", "steps=6", "checkpoint_period=2", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpts = tmp_path / "one" / "checkpoints"
    for step, owner in ((6, 0), (4, 1)):
        data = largest_file(ckpts / str(step) / "state" / f"ocdbt.process_{owner}")
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    proc = launch(tmp_path, *CKPT, *mesh, "run_name=one", "steps=8", "checkpoint_period=2",
                  "distributed_heartbeat_timeout_seconds=10", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ckpts}/2" in proc.stdout and "done: 8 steps" in proc.stdout
    lines = [x for x in proc.stdout.splitlines() if "is unusable" in x]
    assert len(lines) == 2 and f"{ckpts}/6 is unusable" in lines[0] and f"{ckpts}/4 is unusable" in lines[1], lines
    for line in lines:  # process 0 prints it: its own reason (TensorStore's), or that process 1 could not read
        assert re.search(r"is unusable \((process 1 could not read its state|cannot read its state: ValueError: "
                         r"[A-Z_]+: Error reading \")", line), line
    assert (ckpts / "6.unusable").is_dir() and (ckpts / "4.unusable").is_dir()


@pytest.mark.parametrize("text", [
    "Error writing local file \"/d/x\": [os_error_code=28] No space left on device",
    "INTERNAL: ... {\"driver\":\"file\",\"sync\": true}'] [os_error_code=28] [source locations='tensorstore/x.cc']",
])
def test_tensorstore_errors_name_the_os_error_whatever_precedes_it(text):
    # The text before os_error_code depends on which write failed; the line must still say what happened.
    from maxtrain.checkpoint.describe import os_error_text
    assert os_error_text(ValueError(text)) == "No space left on device [errno 28]"
