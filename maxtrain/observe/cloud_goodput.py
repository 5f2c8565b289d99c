"""The goodput ledger's events, also sent to ml-goodput-measurement (MaxText's goodput library) when
enable_goodput_recording is set, so that goodput dashboards and queries built on it (Cloud Logging, Cloud
Monitoring) see maxtrain jobs. The local ledger (goodput.py) stays the record; this is a copy for Google Cloud.

Job name: the run's name (MaxText's job name is its run_name too); log: goodput_<run_name>, MaxText's. What
each ledger event becomes, with the event's own time (backfilled):
  start                   the job's start, and the start of training preparation
  first loop of a start   the end of training preparation, and the start of that step
  step N                  the start of step N (the library counts the time between two step starts)
  a step's data wait      a custom badput event "data_wait" (the library's own data-loading events count the
                          first batch only: it takes later ones as overlapped with compute)
  phase                   a custom badput event of that cause (compile, checkpoint, eval, restore): the
                          library subtracts those that fall between two step starts
  later loop N (rollback) the start of step N again: the library counts the steps after it as lost
  end                     the job's end; the queued entries are flushed
"""

from __future__ import annotations

import datetime
import importlib.util

from maxtrain.config.keys import ConfigError

KEY = "enable_goodput_recording"
PACKAGE = "ml_goodput_measurement"
SMALLEST_WAIT_S = 0.01  # shorter data waits are not sent: two log entries per step would be mostly noise


def check_installed(c) -> None:
    """Before anything compiles: the key set without its package is one line naming the extra."""
    if c[KEY] and importlib.util.find_spec(PACKAGE) is None:
        raise ConfigError(KEY, "needs ml-goodput-measurement: pip install -e \".[goodput]\" (or set it false)")


def _cloud_logger(job_name: str, log_name: str):
    """The library's Cloud Logging writer (tests put a fake in its place)."""
    from ml_goodput_measurement.src.goodput import _CloudLogger
    return _CloudLogger(job_name, log_name)


def _at(t: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc)


class Recorder:
    """Takes the ledger's events (goodput.Ledger.mirror) on process 0 and records them in the library's terms."""

    def __init__(self, run_name: str, say):
        from ml_goodput_measurement import goodput
        self.say, self.log_name = say, f"goodput_{run_name}"
        self.prepared = False  # this start's first loop seen
        self.failed = False
        self.last = 0.0  # the time of the last event: a phase ends at its event and began after the one before
        self.recorder = goodput.GoodputRecorder(run_name, self.log_name, logging_enabled=True,
                                                cloud_logger=_cloud_logger(run_name, self.log_name))

    def __call__(self, event: dict) -> None:
        if self.failed:
            return
        try:
            self._record(event)
        except Exception as e:  # noqa: BLE001 - the copy must never stop the run
            self.failed = True
            self.say(f"warning: {KEY}: stopped sending goodput events ({_text(e)}); the ledger in the run "
                     "directory goes on")

    def _record(self, event: dict) -> None:
        r, t, after = self.recorder, event["t"], self.last
        self.last = t
        if "start" in event:
            r.record_job_start_time(_at(event["start"]))
            r.record_training_preparation_start_time(_at(event["start"]))
        elif "phase" in event:
            self._badput(event["phase"], max(t - event["s"], after), t)
        elif "loop" in event:
            if not self.prepared:
                r.record_training_preparation_end_time(_at(t))
                self.prepared = True
            r.record_step_start_time(event["loop"], _at(t))
        elif "step" in event:
            if event["wait"] >= SMALLEST_WAIT_S:  # within the step: before the step's end, which is now
                self._badput("data_wait", max(t - event["wait"], after), t)
            r.record_step_start_time(event["step"], _at(t))
        elif "end" in event:
            r.record_job_end_time(_at(t))
            r.flush()

    def _badput(self, cause: str, start: float, end: float) -> None:
        """Its start no earlier than the event before (times are rounded to ms): the library counts an event
        only where it lies wholly between two step starts."""
        self.recorder.record_custom_badput_event_start_time(_at(start), cause)
        self.recorder.record_custom_badput_event_end_time(_at(end), cause)


def _text(e: Exception) -> str:
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0]}" if first else type(e).__name__


def recorder(c, say) -> Recorder | None:
    """A Recorder where the key asks for one (call it on process 0 only); where Cloud Logging cannot be
    reached (no credentials, no project), one line says so and the run goes on with the local ledger."""
    if not c[KEY]:
        return None
    try:
        return Recorder(c.run_name, say)
    except Exception as e:  # noqa: BLE001 - google.auth's and the client's errors have no common base here
        say(f"warning: {KEY}: cannot write to Cloud Logging ({_text(e)}); the goodput ledger in the run "
            "directory is kept as always")
        return None
