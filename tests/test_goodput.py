"""The goodput ledger (maxtrain.observe.goodput, python -m maxtrain.goodput) and restarts without a person
(scripts/launch_local.sh --max-restarts)."""

import json
import os
import random
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import TINY, TESTS
from helpers import Output, one_line, read_events, run_cli, saved_arrays
from maxtrain.observe import goodput

LAUNCH = str(TESTS.parent / "scripts" / "launch_local.sh")


def events(*lines):
    return [json.loads(x) if isinstance(x, str) else x for x in lines]


def parts(summary) -> float:
    return summary["productive_s"] + sum(summary["badput"].values())


def test_a_killed_start_loses_its_steps_since_the_checkpoint_and_the_time_to_the_restart():
    job = events(
        {"start": 0.0, "t": 1.0}, {"phase": "compile", "s": 2.0, "t": 4.0}, {"loop": 0, "t": 10.0},
        *({"step": n, "s": 1.0, "wait": 0.5, "t": 10.0 + 1.5 * n} for n in range(1, 7)),  # to t=19
        {"phase": "checkpoint", "s": 1.0, "t": 20.0},  # killed after this: steps 5 and 6 were not saved
        {"start": 30.0, "t": 31.0}, {"phase": "restore", "s": 3.0, "t": 35.0}, {"loop": 4, "t": 36.0},
        *({"step": n, "s": 1.0, "wait": 0.0, "t": 36.0 + n - 4} for n in range(5, 9)),  # to t=40
        {"end": "done", "t": 40.0})
    s = goodput.summarize(job)
    assert s["restarts"] == 1 and s["steps_lost"] == 2 and s["steps"] == 8
    assert s["productive_s"] == 8.0 and s["badput"]["lost"] == 2.0
    assert s["badput"]["down"] == 10.0 and s["badput"]["startup"] == 8.0 + 3.0  # 10 - 2 compile; 36 - 30 - 3
    assert s["badput"]["compile"] == 2.0 and s["badput"]["restore"] == 3.0 and s["badput"]["data_wait"] == 3.0
    assert s["wall_s"] == 20.0 + 10.0 + 10.0 and parts(s) == pytest.approx(s["wall_s"])
    assert s["badput"]["other"] == pytest.approx(0.0) and s["goodput"] == pytest.approx(8.0 / 40.0)
    assert goodput.line(s) == ("goodput 20.0% over 1 restart (40.0 s, 2 steps lost): startup 27.5%, down 25.0%, "
                               "restore 7.5%, data wait 7.5%, lost steps 5.0%, compile 5.0%, checkpoint 2.5%")


def test_a_rollback_loses_the_steps_after_it_and_a_finished_run_raised_later_was_not_down():
    job = events(
        {"start": 0.0, "t": 0.0}, {"loop": 0, "t": 1.0},
        *({"step": n, "s": 1.0, "wait": 0.0, "t": 1.0 + n} for n in range(1, 5)),
        {"phase": "restore", "s": 1.0, "t": 6.0}, {"loop": 2, "t": 6.0},  # step 4 was not finite: back to 2
        *({"step": n, "s": 1.0, "wait": 0.0, "t": 4.0 + n} for n in range(3, 6)),
        {"end": "done", "t": 9.0},
        {"start": 1000.0, "t": 1000.0}, {"loop": 5, "t": 1001.0}, {"step": 6, "s": 1.0, "wait": 0.0, "t": 1002.0},
        {"end": "done", "t": 1002.0})
    s = goodput.summarize(job)
    assert s["steps_lost"] == 2 and s["badput"]["lost"] == 2.0 and s["steps"] == 6
    assert s["restarts"] == 0 and s["badput"]["down"] == 0.0 and s["wall_s"] == 9.0 + 2.0
    assert parts(s) == pytest.approx(s["wall_s"])


def test_once_the_job_has_failed_a_start_says_the_young_daly_interval():
    first = [{"start": 0, "t": 0}, {"loop": 0, "t": 0}, *({"step": n, "s": 1.0, "wait": 0, "t": n} for n in range(1, 51)),
             {"phase": "checkpoint", "s": 2.0, "t": 52}, *({"step": n, "s": 1.0, "wait": 0, "t": n + 2}
                                                            for n in range(51, 101))]  # killed after step 100
    assert goodput.interval_advice(goodput.summarize(first), "checkpoint_period", 50) is None  # no failure yet
    s = goodput.summarize(events(*first, {"start": 200, "t": 200}))
    assert (s["restarts"], s["saves"], s["wall_s"]) == (1, 1, 200)
    # sqrt(2 x 2 s x 200 s) = 28.3 s of 1 s steps
    assert goodput.interval_advice(s, "local_checkpoint_period", 10) == (
        "goodput: 1 failure in 3.3 min (one every 3.3 min); a save holds the loop 2.00 s and a step takes 1.000 s: "
        "the Young-Daly interval, sqrt(2 x save x time between failures), is about 28 steps "
        "(local_checkpoint_period=10 now)")


def test_a_line_cut_by_a_kill_is_skipped_and_the_next_start_is_on_a_line_of_its_own(tmp_path):
    (tmp_path / goodput.FILE).write_text('{"start": 0.0, "t": 0.0}\n{"loop": 0, "t": 1.0}\n{"step": 1, "s": 1')
    ledger = goodput.Ledger(tmp_path, write=True)
    ledger.loop(0)
    ledger.step(1)
    s = ledger.end("done")
    assert s["restarts"] == 1 and s["steps"] == 1
    assert [e.get("start") is not None for e in goodput.read(tmp_path / goodput.FILE)].count(True) == 2


def test_only_process_0_writes_and_a_full_disk_is_one_line(tmp_path):
    ledger = goodput.Ledger(tmp_path, write=False)
    ledger.loop(0)
    ledger.step(1)
    assert ledger.end("done") is None and not (tmp_path / goodput.FILE).exists()
    from maxtrain.observe.writers import MetricsError
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    os.symlink("/dev/full", tmp_path / goodput.FILE)
    with pytest.raises(MetricsError, match=re.escape(f"cannot write {tmp_path / goodput.FILE}: No space left")):
        goodput.Ledger(tmp_path, write=True)


def test_every_run_keeps_a_ledger_that_adds_up_and_says_its_goodput(tmp_path, train_tiny, capsys):
    train_tiny("steps=6", "log_period=2", "enable_checkpointing=true", "checkpoint_period=3",
               "metrics_backends=tensorboard,jsonl")
    run = tmp_path / "tiny"
    s = goodput.summarize(goodput.read(run / goodput.FILE))
    assert s["steps"] == 6 and s["restarts"] == 0 and s["steps_lost"] == 0
    for cause in ("startup", "compile", "checkpoint"):
        assert s["badput"][cause] > 0, cause
    assert parts(s) == pytest.approx(s["wall_s"], rel=1e-3) and s["badput"]["other"] <= 0.02 * s["wall_s"]
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"goodput \d+\.\d% over 0 restarts \(\d+\.\d s, 0 steps lost\): .*", lines[-1]), lines[-3:]
    [events] = (run / "tensorboard").glob("events.out.tfevents.*")
    board = {v.tag: (e.step, v.simple_value) for e in read_events(events) for v in e.summary.value}
    assert {"goodput/goodput", "goodput/wall_s", "goodput/steps_lost", "goodput/compile_s", "goodput/down_s"} <= set(board)
    assert board["goodput/goodput"][0] == 6 and board["goodput/goodput"][1] == pytest.approx(s["goodput"], abs=0.02)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("goodput/") for r in rows for k in r)  # its rows stay the steps'


def test_the_goodput_command_summarizes_a_run_and_refuses_what_is_not_one(tmp_path):
    (tmp_path / goodput.FILE).write_text("\n".join(json.dumps(e) for e in (
        {"start": 0.0, "t": 0.0}, {"loop": 0, "t": 2.0}, {"step": 1, "s": 2.0, "wait": 0.0, "t": 4.0},
        {"end": "done", "t": 4.0})))
    code, out, err, _ = run_cli(str(tmp_path), "--json", module="maxtrain.goodput")
    assert code == 0, err
    s = json.loads(out)
    assert {"wall_s", "productive_s", "goodput", "badput", "restarts", "steps_lost"} <= set(s)
    assert s["wall_s"] == 4.0 and s["goodput"] == 0.5 and s["badput"]["startup"] == 2.0
    code, out, err, _ = run_cli(str(tmp_path), module="maxtrain.goodput")
    assert code == 0 and out.splitlines()[0] == "goodput 50.0% over 0 restarts (4.0 s, 0 steps lost): startup 50.0%"
    code, out, err, _ = run_cli(str(tmp_path / "nope"), module="maxtrain.goodput")
    assert code == 2 and one_line(err).startswith(f"input error: {tmp_path / 'nope' / goodput.FILE}: cannot read it")
    code, out, err, _ = run_cli(module="maxtrain.goodput")
    assert code == 2 and err.startswith("usage:")


def test_the_launcher_refuses_a_bad_restart_count():
    done = subprocess.run([LAUNCH, "--max-restarts", "-1", "2", TINY], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--max-restarts needs a count" in done.stderr


@pytest.mark.slow
def test_a_job_killed_again_and_again_restarts_itself_and_ends_as_if_never_killed(tmp_path):
    """kill -9 of a random process of the job (a supervisor or its training child) at random steps, twice:
    the launcher stops the rest and starts the job again each time, from the newest local copy; it ends by
    itself with the params of a run never killed, and the ledger's lost steps are the steps trained twice."""
    env = dict(os.environ, MAXTRAIN_LOG_DIR=str(tmp_path / "logs"), MAXTRAIN_DEVICES_PER_PROCESS="4",
               PYTHON=sys.executable)
    steps, period = 24, 4  # local copies every 4 steps, persistent ones every 20
    args = [TINY, f"base_output_directory={tmp_path}", f"steps={steps}", "log_period=1", "enable_checkpointing=true",
            "checkpoint_period=20", "ici_fsdp_parallelism=4", "dcn_data_parallelism=2"]
    tiers = [f"local_checkpoint_directory={tmp_path / 'local'}", f"local_checkpoint_period={period}"]
    reference = subprocess.run([LAUNCH, "2", *args, "run_name=reference"], capture_output=True, text=True,
                               env=env, cwd=TESTS.parent, timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]
    t0 = time.time()
    proc = subprocess.Popen([LAUNCH, "--max-restarts", "5", "2", *args, *tiers, "run_name=chaos"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=TESTS.parent, start_new_session=True)
    output, rng, kills = Output(proc), random.Random(0), 0

    def last_step(start: int) -> int:  # start `start`'s (0, 1, ...) latest step: each start's first line is "maxtrain:"
        lines = list(output.lines)
        begun = [i for i, x in enumerate(lines) if x.startswith("maxtrain: ")]
        steps = [int(m.group(1)) for x in lines[begun[start]:] if (m := re.match(r"step\s+(\d+)/", x))] \
            if len(begun) > start else []
        return steps[-1] if steps else -1
    try:
        for start in range(2):
            deadline = time.time() + 300
            while time.time() < deadline and last_step(start) < 0 and proc.poll() is None:
                time.sleep(0.05)
            target = last_step(start) + rng.randint(1, 2 * period)  # a random step of this start
            while time.time() < deadline and last_step(start) < target and proc.poll() is None:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.3))  # then somewhere in the step, at times in a save
            pids = subprocess.run(["pgrep", "-f", f"maxtrain.train .*base_output_directory={tmp_path} .*run_name=chaos"],
                                  capture_output=True, text=True).stdout.split()
            if not pids:
                break
            os.kill(int(rng.choice(pids)), 9)  # a supervisor or its training child
            kills += 1
            deadline = time.time() + 120  # until the launcher has started the job again
            while time.time() < deadline and sum("restart " in x for x in output.err) < kills:
                time.sleep(0.1)
        output.wait_for(r"^goodput ", timeout=600)
        wall = time.time() - t0  # the job's, to its last line (its processes' exit comes after)
        code, lines, err = output.finish(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert code == 0 and kills == 2, (kills, lines[-20:], err[-3000:])
    restarts = [x for x in err.splitlines() if x.startswith("launch_local:")]
    assert len(restarts) == 2 and all(re.fullmatch(r"launch_local: process [01] exited with code \d+; restart "
                                                   r"[12] of 5: the whole job starts again", x) for x in restarts), err
    assert lines[-2].startswith(f"done: {steps} steps") and lines[-1].startswith("goodput ")
    assert any(re.match(r"goodput: [12] failures? in .* the Young-Daly interval, .* is about \d+ steps "
                        r"\(local_checkpoint_period=4 now\)$", x) for x in lines), lines
    resumes = [x for x in lines if x.startswith("resumed from ")]
    assert resumes and all(" of the local tier " in x for x in resumes), resumes
    run = tmp_path / "chaos"
    chaos, reference = (saved_arrays(d / "checkpoints" / str(steps) / "state") for d in (run, tmp_path / "reference"))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(chaos["params"]), jax.tree.leaves(
        reference["params"]), strict=True))
    trained = [int(m.group(1)) for x in lines if (m := re.match(r"step\s+(\d+)/", x))]
    s = json.loads(subprocess.run([sys.executable, "-m", "maxtrain.goodput", str(run), "--json"], capture_output=True,
                                  text=True, timeout=60, check=True).stdout)
    # The ledger records a step as soon as its metrics are read, a moment before its line is printed: a kill in
    # between hides that step from the printed lines (at most one a kill); the ledger's own record replays exactly.
    recorded = [e["step"] for e in goodput.read(run / goodput.FILE) if "step" in e]
    twice = len(trained) - len(set(trained))
    assert s["restarts"] == 2 and s["steps_lost"] == len(recorded) - len(set(recorded)) <= period * 2, (s, trained)
    assert twice <= s["steps_lost"] <= twice + 2, (s, trained)
    assert s["badput"]["down"] > 0 and s["badput"]["restore"] > 0
    assert parts(s) == pytest.approx(s["wall_s"], rel=1e-3) and s["badput"]["other"] <= 0.02 * s["wall_s"]
    assert abs(s["wall_s"] - wall) <= 0.02 * wall, (s, wall)
    assert f"{100 * s['goodput']:.1f}% over 2 restarts" in lines[-1]


def test_the_checkpoint_interval_advice_from_the_saves_and_the_expected_failures(tiny_config):
    c = tiny_config("enable_checkpointing=true", "local_checkpoint_directory=/tmp/x", "local_checkpoint_period=10",
                    "checkpoint_period=500")
    lines = goodput.interval_lines(c, {"local": 0.4, "persistent": 1.5}, restart_s=95, step_s=1.0)
    # 8 chips: 50,000 / 8 = 6,250 h between failures; sqrt(2 x 0.4 s x 22.5e6 s) = 4,243 s of 1 s steps
    assert lines[0] == (
        "checkpoint intervals: a failure every 6.25e+03 h expected (8 chips at one failure per 50,000 chip-hours; "
        "failure_interval_hours sets it); a local save holds the loop 0.40 s, a persistent save holds the loop 1.50 s, "
        "a restart takes 95 s, a step 1.000 s: Young-Daly's interval is 4243 steps for the local tier "
        "(local_checkpoint_period=10) and 8216 steps for the persistent tier (checkpoint_period=500); expected "
        "goodput 95.7%")
    assert lines[1:] == [
        "warning: local_checkpoint_period=10 is 0.0024x Young-Daly's 4243 steps: saves cost more than the failures "
        "they guard against",
        "warning: checkpoint_period=500 is 0.061x Young-Daly's 8216 steps: saves cost more than the failures they "
        "guard against"]
    # a pod's rate, set: one failure an hour; persistent only: 2 s / 50 s + (25 s + 60 s) / 3600 s lost = 6.4%
    c = tiny_config("enable_checkpointing=true", "checkpoint_period=100", "failure_interval_hours=1")
    lines = goodput.interval_lines(c, {"persistent": 2.0}, restart_s=60, step_s=0.5)
    assert lines == ["checkpoint intervals: a failure every 1 h expected (failure_interval_hours); a persistent save "
                     "holds the loop 2.00 s, a restart takes 60 s, a step 0.500 s: Young-Daly's interval is 240 steps "
                     "for the persistent tier (checkpoint_period=100); expected goodput 93.6%"]


def test_a_run_says_the_intervals_once_its_saves_are_measured(tmp_path, train_tiny, capsys):
    train_tiny("enable_checkpointing=true", "steps=8", "checkpoint_period=5", "failure_interval_hours=0.5",
               f"local_checkpoint_directory={tmp_path / 'local'}", "local_checkpoint_period=2")
    out = capsys.readouterr().out
    said = [x for x in out.splitlines() if x.startswith("checkpoint intervals: ")]
    assert len(said) == 1 and re.match(r"checkpoint intervals: a failure every 0.5 h expected \(failure_interval_hours\); "
                                       r"a local save holds the loop [\d.]+ s, a persistent save holds the loop [\d.]+ "
                                       r"s, .*local_checkpoint_period=2.*checkpoint_period=5", said[0]), out
    assert "warning: local_checkpoint_period=2 is " in out  # a few ms per save against 30 minutes


class CloudLog:
    """ml-goodput-measurement's Cloud Logging client, as a list: what the recorder writes, the calculator reads."""

    def __init__(self, fail_after=None):
        self.entries, self.job_start_time, self.fail_after, self.flushed = [], None, fail_after, 0

    def write_cloud_logging_entry(self, entry):
        if self.fail_after is not None and len(self.entries) >= self.fail_after:
            raise RuntimeError("503 The service is currently unavailable.\nmore")
        self.entries.append(entry)

    def flush(self):
        self.flushed += 1

    def read_cloud_logging_entries(self, *args, **kwargs):
        starts = [e["job_start_time"] for e in self.entries if "job_start_time" in e]
        if starts and self.job_start_time is None:
            import datetime
            self.job_start_time = datetime.datetime.fromtimestamp(starts[0], tz=datetime.timezone.utc)
        return list(self.entries), (None, None)


def test_with_enable_goodput_recording_the_ledger_also_goes_to_ml_goodput_measurement(tmp_path, train_tiny,
                                                                                     monkeypatch, capsys):
    from ml_goodput_measurement.src.goodput import GoodputCalculator
    from ml_goodput_measurement.src.goodput_utils import BadputType
    from maxtrain.observe import cloud_goodput
    log, names = CloudLog(), []
    monkeypatch.setattr(cloud_goodput, "_cloud_logger", lambda *n: names.append(n) or log)
    for steps in (6, 10):  # a finished run, raised to more steps: a second start of the job
        monkeypatch.setenv(goodput.STARTED_ENV, str(time.time()))  # as if in a process of its own
        train_tiny(f"steps={steps}", "enable_checkpointing=true", "checkpoint_period=3", "run_name=cloud",
                   "enable_goodput_recording=true")
    assert names == [("cloud", "goodput_cloud")] * 2  # MaxText's job name and log
    assert sum("job_start_time" in e for e in log.entries) == sum("job_end_time" in e for e in log.entries) == 2
    assert log.flushed == 2  # at each start's end: the queued entries are committed before the process exits
    assert [e["step_count"] for e in log.entries if "step_count" in e] == [0, 1, 2, 3, 4, 5, 6] + [6, 7, 8, 9, 10]
    causes = {e["custom_badput_event_type"] for e in log.entries if "custom_badput_event_type" in e}
    assert {"compile", "checkpoint", "restore"} <= causes, causes
    ours = goodput.summarize(goodput.read(tmp_path / "cloud" / goodput.FILE))
    calculator = GoodputCalculator("cloud", "goodput_cloud", cloud_logger=log, cache_dir=str(tmp_path))
    theirs, badput, last_step = calculator.get_job_goodput(include_badput_breakdown=True)
    assert last_step == 10
    # The same seconds in the library's terms (its breakdown is in percent of the job's time, first start to
    # last end): everything before a start's first step is its training preparation; the saves between steps
    # are custom badput (the final saves come after the last step: the library counts them as recovery).
    job_s = ours["wall_s"]
    before_the_steps = sum(ours["badput"][k] for k in ("startup", "compile", "restore"))
    between_steps = [e for start in goodput._split(goodput.read(tmp_path / "cloud" / goodput.FILE))
                     for e, later in zip(start, start[1:]) if e.get("phase") == "checkpoint" and "step" in later]
    assert len(between_steps) == 2  # after steps 3 and 9 (6 ends the first start)
    assert badput[BadputType.TRAINING_PREP] * job_s / 100 == pytest.approx(before_the_steps, rel=0.02), badput
    assert badput[BadputType.CUSTOM_BADPUT_EVENTS]["CHECKPOINT"] * job_s / 100 == pytest.approx(
        sum(e["s"] for e in between_steps), rel=0.05, abs=0.005), badput
    assert badput[BadputType.OTHER] < 2 and 0 < theirs < 100, badput
    assert "warning" not in capsys.readouterr().out


def test_goodput_recording_that_cannot_reach_cloud_logging_is_one_warning_and_the_run_goes_on(
        tmp_path, train_tiny, monkeypatch, capsys, tiny_config):
    from maxtrain.config.keys import ConfigError
    from maxtrain.observe import cloud_goodput

    def no_credentials(*names):
        raise RuntimeError("Your default credentials were not found. To set up Application Default Credentials, "
                           "see https://cloud.google.com/docs/authentication/external/set-up-adc\nfor more")
    monkeypatch.setattr(cloud_goodput, "_cloud_logger", no_credentials)
    train_tiny("steps=2", "enable_goodput_recording=true", "run_name=a")
    out = capsys.readouterr().out
    assert ("warning: enable_goodput_recording: cannot write to Cloud Logging (RuntimeError: Your default "
            "credentials were not found.") in out and "the goodput ledger in the run directory is kept" in out
    assert goodput.summarize(goodput.read(tmp_path / "a" / goodput.FILE))["steps"] == 2

    log = CloudLog(fail_after=5)  # the service goes away mid-run: one line, then nothing more is sent
    monkeypatch.setattr(cloud_goodput, "_cloud_logger", lambda *names: log)
    train_tiny("steps=4", "enable_goodput_recording=true", "run_name=b")
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning: enable_goodput_recording")]
    assert said == ["warning: enable_goodput_recording: stopped sending goodput events (RuntimeError: 503 The "
                    "service is currently unavailable.); the ledger in the run directory goes on"]
    assert len(log.entries) == 5 and goodput.summarize(goodput.read(tmp_path / "b" / goodput.FILE))["steps"] == 4

    monkeypatch.setattr(cloud_goodput, "PACKAGE", "no_such_package_here")  # the extra not installed
    with pytest.raises(ConfigError, match=re.escape('enable_goodput_recording: needs ml-goodput-measurement: pip '
                                                    'install -e ".[goodput]" (or set it false)')):
        cloud_goodput.check_installed(tiny_config("enable_goodput_recording=true"))
