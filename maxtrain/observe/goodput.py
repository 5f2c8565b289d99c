"""The goodput ledger: where a job's wall time went, over all its restarts, in <run_dir>/goodput.jsonl.

Process 0 appends one JSON line per event as it happens, flushed, so a kill -9 loses at most the line being
written (`t`: wall-clock seconds at the event's end):
  {"start": T0, "t": T}                   a start of the job; T0 is when its command's process began
  {"phase": CAUSE, "s": S, "t": T}        the training thread was held S seconds by CAUSE (compile, restore,
                                          checkpoint, eval)
  {"loop": N, "t": T}                     training goes on from step N; steps after N recorded before are lost
  {"step": N, "s": S, "wait": W, "t": T}  step N: S productive seconds, W seconds waiting for a batch
  {"end": WHY, "t": T}                    the start ended normally: "done" (steps reached or data used up),
                                          "preempted" (saved and stopped), "failed" (a one-line error)
`summarize` replays it. A start's time runs from T0 to its last event: startup is what comes before its
first `loop` and no phase explains (process start, distributed init, state init); down time runs from one
start's last event to the next start's T0 (not after a "done" start: a finished run raised to more steps
was not down). "other" is whatever no event explains: the events above keep it small.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from maxtrain.runtime import storage

FILE = "goodput.jsonl"
STARTED_ENV = "MAXTRAIN_STARTED_AT"  # a supervisor's child inherits the command's start time through it
CHIP_HOURS_PER_FAILURE = 50_000  # Llama 3 405B: 419 interruptions in 54 days on 16,384 GPUs (one per 50,700)
FAR = 3.0  # a period this many times above or below Young-Daly's is warned about
CAUSES = ("startup", "compile", "restore", "data_wait", "checkpoint", "eval", "lost", "down", "other")
NAMES = {"lost": "lost steps", "data_wait": "data wait"}


def process_start() -> float:
    """Wall-clock time at which the command's process began: its supervisor's, when this is a child (which
    JAX's distributed start-up and a restore can follow by many seconds)."""
    inherited = os.environ.get(STARTED_ENV)
    if inherited:
        try:
            return float(inherited)
        except ValueError:
            pass
    try:  # /proc: the process's start in clock ticks after boot, and the seconds since boot
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


class Ledger:
    """This start's events, appended to the run's ledger by process 0 (on every other process a no-op that
    still measures). Steps are accounted in the training thread: a step's productive time is the time since
    the previous step's, less the phases and the data wait in between."""

    def __init__(self, run_dir, write: bool, mirror=None):
        """mirror: called with each event written (cloud_goodput.Recorder), or None."""
        self.path = run_dir / FILE
        self.file, self.mirror = None, mirror
        self.mark = time.time()  # where the time the next step accounts for begins
        self.held = self.wait = 0.0  # phases and data wait since the mark
        if write:
            try:
                self.file = storage.open_append(self.path)
            except OSError as e:
                self._failed(e)
        self._write({"start": round(process_start(), 3)}, after_a_cut=True)

    def _failed(self, e: OSError):
        from maxtrain.observe.writers import MetricsError
        self.close()
        raise MetricsError(f"cannot write {self.path}: {e.strerror or storage.error_text(e)}") from None

    def _write(self, event: dict, after_a_cut: bool = False) -> None:
        """after_a_cut: on a line of its own even when a kill cut the last one short (an empty line is skipped)."""
        if self.file is None:
            return
        event = {**event, "t": round(time.time(), 3)}
        try:
            self.file.write("\n" * after_a_cut + json.dumps(event) + "\n")
            self.file.flush()
        except OSError as e:
            self._failed(e)
        if self.mirror is not None:
            self.mirror(event)

    def add(self, cause: str, seconds: float) -> None:
        """`seconds` just spent on `cause` (measured by the caller)."""
        self.held += seconds
        self._write({"phase": cause, "s": round(seconds, 4)})

    @contextlib.contextmanager
    def phase(self, cause: str):
        t0 = time.time()
        try:
            yield
        finally:
            self.add(cause, time.time() - t0)

    def waited(self, seconds: float) -> None:
        self.wait += seconds

    def loop(self, step: int) -> None:
        self.mark, self.held, self.wait = time.time(), 0.0, 0.0
        self._write({"loop": step})

    def step(self, step: int) -> None:
        now = time.time()
        productive = max(now - self.mark - self.held - self.wait, 0.0)
        self._write({"step": step, "s": round(productive, 4), "wait": round(self.wait, 4)})
        self.mark, self.held, self.wait = now, 0.0, 0.0

    def end(self, why: str) -> dict | None:
        """The last event of this start; the job's summary so far (process 0), else None."""
        self._write({"end": why})
        if self.file is None:
            return None
        self.close()
        return summarize(read(self.path))

    def close(self) -> None:
        if self.file is not None:
            f, self.file = self.file, None
            try:
                f.close()
            except OSError:
                pass


def read(path) -> list[dict]:
    """The ledger's events; a line cut short by a kill is skipped."""
    events = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("t"), (int, float)):
            events.append(event)
    return events


def summarize(events: list[dict]) -> dict:
    """The job's wall time split into productive seconds and badput by cause (CAUSES), and its restarts."""
    badput = dict.fromkeys(CAUSES, 0.0)
    restarts, steps_lost, saves = 0, 0, 0
    kept: dict[int, float] = {}  # step -> productive seconds, of the steps not thrown away (yet)
    starts = _split(events)
    previous_end, previous_why = None, "done"
    wall = 0.0
    for start in starts:
        t0, last = start[0]["start"], start[-1]["t"]
        if previous_end is not None and previous_why != "done":
            restarts += 1
            badput["down"] += max(t0 - previous_end, 0.0)
        if previous_end is not None:  # train() called again in the same process: its time begins at the call
            t0 = max(t0, previous_end)
        span = max(last - t0, 0.0)
        wall += span
        accounted, loop_at = 0.0, None
        for e in start[1:]:
            if "phase" in e:
                cause = e["phase"] if e["phase"] in badput else "other"
                badput[cause] += e["s"]
                accounted += e["s"]
                saves += cause == "checkpoint"
            elif "loop" in e:
                if loop_at is None:
                    loop_at = e["t"]
                    badput["startup"] += max(loop_at - t0 - accounted, 0.0)
                    accounted = loop_at - t0
                for n in [n for n in kept if n > e["loop"]]:
                    badput["lost"] += kept.pop(n)
                    steps_lost += 1
            elif "step" in e:
                if e["step"] in kept:  # trained again after a rollback that was not recorded
                    badput["lost"] += kept[e["step"]]
                    steps_lost += 1
                kept[e["step"]] = e["s"]
                badput["data_wait"] += e["wait"]
                accounted += e["s"] + e["wait"]
        if loop_at is None:
            badput["startup"] += max(span - accounted, 0.0)
            accounted = span
        badput["other"] += max(span - accounted, 0.0)
        previous_end, previous_why = last, start[-1].get("end")
    productive = sum(kept.values())
    wall += badput["down"]
    return {"wall_s": wall, "productive_s": productive, "goodput": productive / wall if wall > 0 else 0.0,
            "badput": badput, "restarts": restarts, "steps_lost": steps_lost, "steps": len(kept), "saves": saves}


def _split(events: list[dict]) -> list[list[dict]]:
    """The events by start (anything before the first start is dropped)."""
    starts: list[list[dict]] = []
    for e in events:
        if "start" in e:
            starts.append([e])
        elif starts:
            starts[-1].append(e)
    return starts


def line(summary: dict) -> str:
    """`goodput 94.1% over 3 restarts: lost steps 2.3%, compile 1.8%, ...` (causes of at least 0.05%)."""
    wall = summary["wall_s"] or 1.0
    parts = sorted(((s / wall, c) for c, s in summary["badput"].items() if s / wall >= 0.0005), reverse=True)
    n = summary["restarts"]
    return (f"goodput {100 * summary['goodput']:.1f}% over {n} restart{'s' * (n != 1)}"
            f" ({summary['wall_s']:.1f} s, {summary['steps_lost']} step{'s' * (summary['steps_lost'] != 1)} lost)"
            + (": " + ", ".join(f"{NAMES.get(c, c)} {100 * f:.1f}%" for f, c in parts) if parts else ""))


def interval_advice(summary: dict, key: str, period: int) -> str | None:
    """Once the job has failed: its mean time between failures M, what a save holds the loop (d), and the
    Young-Daly checkpoint interval sqrt(2 d M) in steps, against the period `key` sets now."""
    n, steps, saves = summary["restarts"], summary["steps"], summary["saves"]
    if not (n and steps and saves and summary["productive_s"] > 0):
        return None
    mtbf, save = summary["wall_s"] / n, summary["badput"]["checkpoint"] / saves
    step = summary["productive_s"] / steps
    best = max(round((2 * save * mtbf) ** 0.5 / step), 1)
    return (f"goodput: {n} failure{'s' * (n != 1)} in {summary['wall_s'] / 60:.1f} min (one every {mtbf / 60:.1f} "
            f"min); a save holds the loop {save:.2f} s and a step takes {step:.3f} s: the Young-Daly interval, "
            f"sqrt(2 x save x time between failures), is about {best} steps ({key}={period} now)")


def young_daly(save_s: float, between_failures_s: float) -> float:
    """The checkpoint interval that loses least (Young 1974, Daly 2006): sqrt(2 x save cost x MTBF), seconds."""
    return (2 * save_s * between_failures_s) ** 0.5


def interval_lines(c, blocked: dict[str, float], restart_s: float, step_s: float) -> list[str]:
    """From each tier's measured save (what it held the loop), this start's restart cost and the step time:
    Young-Daly's interval for each tier, the expected goodput, and a warning for a period far from it."""
    mtbf = 3600 * (c.failure_interval_hours or CHIP_HOURS_PER_FAILURE / c.num_devices)
    keys = {"local": "local_checkpoint_period", "persistent": "checkpoint_period"}
    periods = {tier: c[key] for tier, key in keys.items() if tier in blocked}
    best = {tier: max(round(young_daly(blocked[tier], mtbf) / step_s), 1) for tier in periods}
    lost = (min(periods.values()) * step_s / 2 + restart_s) / mtbf  # per failure: half an interval, the restart
    overhead = sum(blocked[t] / (periods[t] * step_s) for t in periods) + lost
    source = "failure_interval_hours" if c.failure_interval_hours else \
        f"{c.num_devices:,} chips at one failure per {CHIP_HOURS_PER_FAILURE:,} chip-hours; failure_interval_hours sets it"
    lines = [f"checkpoint intervals: a failure every {mtbf / 3600:.3g} h expected ({source}); "
             + ", ".join(f"a {t} save holds the loop {blocked[t]:.2f} s" for t in periods)
             + f", a restart takes {restart_s:.0f} s, a step {step_s:.3f} s: Young-Daly's interval is "
             + " and ".join(f"{best[t]} steps for the {t} tier ({keys[t]}={periods[t]})" for t in periods)
             + f"; expected goodput {100 * max(1 - overhead, 0):.1f}%"]
    for t in periods:
        ratio = periods[t] / best[t]
        if ratio > FAR or ratio < 1 / FAR:
            lines.append(f"warning: {keys[t]}={periods[t]} is {ratio:.2g}x Young-Daly's {best[t]} steps: "
                         + ("failures will cost more than saving more often would" if ratio > 1 else
                            "saves cost more than the failures they guard against"))
    return lines


def start_advice(ledger: Ledger, c) -> str | None:
    """interval_advice for the job so far, at a start (process 0; None without checkpoints or failures)."""
    if ledger.file is None or not c.enable_checkpointing:
        return None
    try:
        summary = summarize(read(ledger.path))
    except OSError:
        return None
    key = "local_checkpoint_period" if c.local_checkpoint_directory else "checkpoint_period"
    return interval_advice(summary, key, c[key])


def metrics(summary: dict) -> dict[str, float]:
    """goodput/* scalars for the metrics backends."""
    return {"goodput": summary["goodput"], "wall_s": summary["wall_s"], "productive_s": summary["productive_s"],
            "restarts": float(summary["restarts"]), "steps_lost": float(summary["steps_lost"]),
            **{f"{cause}_s": s for cause, s in summary["badput"].items()}}
