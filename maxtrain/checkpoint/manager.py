"""Orbax checkpoints you can trust: train state, data-iterator state, model shape and a digest, saved
together, async; a restore verifies what it read and falls back to the newest good step.

Layout: base_output_directory/run_name/checkpoints/<step>/{state,data,model,digest}. Orbax writes each
step into a temporary directory and renames it when complete, so a save cut short by a kill is never
listed as a step. `digest` holds, for every array of the state, its shape, dtype and two checksums of
its bits, computed on device from the state that was saved (which must be finite). A restore compares
them with what it read: a step that cannot be read or does not match (bit rot, a truncated or missing
file, an empty directory) is reported in one line, moved aside to `<step>.unusable` (never deleted),
and the next older step is tried.

Which steps hold a model seen to work is trust.py's (trusted / rejected / pending). Retention is ours,
not Orbax's: old steps are deleted only once the newest save is known complete, so a save that fails
(disk full, read-only) never costs the last good checkpoint, and never the newest trusted step. A resume
skips rejected steps (moved aside to `<step>.untrusted`). A failed save ends the run with one line naming
the path and the OS error.

A second, local tier (local.py: each process's shards on its own disk, every local_checkpoint_period
steps) holds the same things. restore() is the one place that decides which step of which tier a start
or a rollback goes back to: the newest step not rejected that reads and verifies, from either tier (the
local copy first: it is faster to read).

Start-up order (as MaxText): resume this run's latest checkpoint; else load_full_state_path;
else load_parameters_path (fresh optimizer); else fresh init.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from maxtrain.config.load import Config

from maxtrain.checkpoint.describe import (CheckpointError, RESUME_HINT, check_layout, check_model,
                                          model_signature, os_error_text, read_error_text)
from maxtrain.checkpoint.digest import Corrupt, digest, json_sha256, verify
from maxtrain.checkpoint import local as local_lib
from maxtrain.checkpoint import orbax_quiet
from maxtrain.runtime import pathways
from maxtrain.runtime import storage
from maxtrain.runtime.errors import ConfigError, NonFiniteState, RunError
from maxtrain.checkpoint.trust import Trust

log = logging.getLogger("maxtrain")
DIGEST_VERSION = 1
BARRIER_PREFIX = "maxtrain"  # of Orbax's barriers' names: we join the one that ends a restore (_restore_together)


class SaveError(RunError):
    """A save that failed (no space, read-only, permission): one line, exit code 1."""
    kind = "checkpoint"


orbax_quiet.install()


def _processes_failing(ok: bool) -> list[int]:
    """The processes where `ok` is false: a fallback decision must be the same everywhere."""
    if jax.process_count() == 1:
        return [] if ok else [0]
    from jax.experimental import multihost_utils
    oks = multihost_utils.process_allgather(np.array(ok))
    return [i for i, good in enumerate(np.asarray(oks).reshape(-1)) if not good]


def _agree(ok: bool, why: str, what: str) -> None:
    """Raises Corrupt on every process if `ok` is false on any: this one's reason, or which process failed."""
    failing = _processes_failing(ok)
    if failing:
        raise Corrupt(why if not ok else f"process {failing[0]} {what}")


# ---------------------------------------------------------------------------------------------
# This run's checkpoints


class Checkpointer:
    def __init__(self, c: Config, also_at: int | None = None):
        self.config, self.also_at = c, also_at  # also_at: a step saved whatever the period
        self.directory = storage.absolute(c.base_output_directory, "base_output_directory") / c.run_name / "checkpoints"
        for leftover in incomplete_steps(self.directory):
            print(f"warning: ignoring incomplete checkpoint {leftover.name} (a save was interrupted)", flush=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # retention is ours: see _prune
            enable_async_checkpointing=c.async_checkpointing,
            cleanup_tmp_directories=True,
            create=True,
            multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=BARRIER_PREFIX))
        # Pathways' single controller writes each array on its own, not through OCDBT (as MaxText under it)
        handlers = {"state": ocp.StandardCheckpointHandler(
            use_ocdbt=False, multiprocessing_options=options.multiprocessing_options)} if pathways.used() else None
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers,
                                                 item_names=("state", "data", "model", "digest"))
        except OSError as e:
            raise CheckpointError(f"cannot use {self.directory}: {os_error_text(e)}") from None
        self._unconfirmed: int | None = None  # a save started but not yet known complete
        self._save_started = 0.0
        self.trust = Trust(self.directory, c.loss_spike_factor)
        self.local = None
        if c.local_checkpoint_directory:
            try:
                self.local = local_lib.LocalTier(Path(c.local_checkpoint_directory).absolute(), c.run_name,
                                                 c.local_checkpoint_period)
            except OSError as e:
                raise ConfigError("local_checkpoint_directory", f"cannot write {c.local_checkpoint_directory}: "
                                  f"{os_error_text(e)}") from None
        self.resumed_line = ""  # what restore() restored, from which tier, and why
        self._run_id: str | None = None
        self.blocked: dict[str, float] = {}  # tier -> the least a save held the loop (not the first: it compiles)
        self._saves = 0

    def run_identity(self) -> str | None:
        """The run's first start (the first line of its starts.jsonl), hashed: a local copy holds it, so that
        copies left on a host by an earlier run of the same name, whose outputs were deleted, are not resumed."""
        try:
            first = (self.directory.parent / "starts.jsonl").read_text().split("\n", 1)[0]
        except (OSError, ValueError):
            return None
        return json_sha256(first)[:16] if first.strip() else None

    def persistent_due(self, step: int) -> bool:
        """Every checkpoint_period steps, and a wsd schedule's last step before its decay (where an extended
        run goes on from). (Orbax's own schedule would also save a run's first step.)"""
        return step % self.config.checkpoint_period == 0 or step == self.also_at

    def due(self, step: int) -> bool:
        return self.persistent_due(step) or (self.local is not None and self.local.due(step))

    def save(self, step: int, state, data_state: dict, final: bool = False) -> None:
        """Starts saving `step` (the loop decides when) to the tiers due, the persistent one if `final` (a
        preemption, the last step); returns once device buffers are copied."""
        persistent = final or self.persistent_due(step)
        if persistent:
            self._confirm()
        started = time.perf_counter()  # the checksums (a copy of the state to the host) are part of the save
        entries, finite = digest(state)
        if not finite:  # finite gradients overflowed the parameters: never write such a state
            raise NonFiniteState(f"step {step}: the parameters or optimizer state hold non-finite values")
        record = {"version": DIGEST_VERSION, "leaves": entries, "data_sha256": json_sha256(data_state)}
        checksums, self._saves = time.perf_counter() - started, self._saves + 1
        if self.local is not None and self.local.due(step):
            t0 = time.perf_counter()
            self._local_failed(self.local.wait())
            self._run_id = self._run_id or self.run_identity()
            self.local.save(step, state, data_state, record | {"run": self._run_id,
                                                               "model": model_signature(self.config)},
                            keep={self.trust.newest_trusted(self.local.steps())})
            self._held("local", checksums + time.perf_counter() - t0)
        if not persistent:
            try:
                self.trust.saved(step)
            except OSError as e:
                raise self._verdicts_failed(e) from None
            return
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state),
                                  model=ocp.args.JsonSave(model_signature(self.config)),
                                  digest=ocp.args.JsonSave(record))
        self._save_started = started
        t0 = time.perf_counter()
        try:
            self.manager.save(step, args=args, force=True)
        except Exception as e:
            raise self._failed(step, e) from None
        self._held("persistent", checksums + time.perf_counter() - t0)
        self._unconfirmed = step
        try:
            self.trust.saved(step)
        except OSError as e:
            raise self._failed(step, e) from None

    def observe(self, step: int, loss: float, finite: bool) -> None:
        """Every step's loss, in order: the first step on a saved state's parameters judges that checkpoint."""
        try:
            why = self.trust.observe(step, loss, finite)
        except OSError as e:
            raise self._verdicts_failed(e) from None
        if why is not None and jax.process_index() == 0:
            print(f"warning: checkpoint {step - 1} is not trusted: {why}; {self.last_trusted()}", flush=True)

    def last_trusted(self) -> str:
        """Where the run can go back to, for error lines."""
        good = self.trust.newest_trusted(self.manager.all_steps())
        return f"last trusted checkpoint: step {good} in {self.directory}" if good is not None else \
            "no trusted checkpoint yet"

    def _held(self, tier: str, seconds: float) -> None:
        if self._saves > 1:
            self.blocked[tier] = min(self.blocked.get(tier, seconds), seconds)

    def _local_failed(self, why: str | None) -> None:
        """A local save that failed (a full RAM disk): this process writes no more local copies; the run and
        the persistent tier go on."""
        if why is not None:
            print(f"warning: process {jax.process_index()}: a local checkpoint could not be written to "
                  f"{self.local.root}: {why}; this process keeps no more local copies in this run (the "
                  f"persistent tier goes on)", flush=True)

    def poll(self) -> None:
        """Between steps: a background save that failed ends the run now, not at the next save.
        (One process only: asking Orbax whether a save is in progress is a barrier across processes.)"""
        if self.local is not None and not self.local.writing():
            self._local_failed(self.local.wait())
        if self._unconfirmed is not None and jax.process_count() == 1 and not self.manager.is_saving_in_progress():
            self._confirm()

    def _confirm(self) -> None:
        """Waits for the save in flight; raises SaveError if it failed, else applies retention."""
        if self._unconfirmed is None:
            return
        step, self._unconfirmed = self._unconfirmed, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._failed(step, e) from None
        if jax.process_index() == 0:  # said once known durable: the next poll, save, restore or close
            # several processes are not polled (a barrier): this is the next save, its time not the save's
            took = f"{time.perf_counter() - self._save_started:.1f} s, " if jax.process_count() == 1 else ""
            print(f"saved checkpoint {step} ({took}{self.directory / str(step)})", flush=True)
        self._prune()

    def _failed(self, step: int, e: BaseException) -> SaveError:
        return SaveError(f"saving step {step} to {self.directory / str(step)} failed: {os_error_text(e)}; "
                         f"the last good checkpoint is {self._last_good(but=step)}")

    def _verdicts_failed(self, e: OSError) -> SaveError:
        return SaveError(f"writing the checkpoints' verdicts to {self.trust.path} failed: {os_error_text(e)}; "
                         f"the last good checkpoint is {self._last_good(but=self._unconfirmed)}")

    def _forget(self, steps) -> None:
        try:
            self.trust.forget(steps)
        except OSError as e:
            raise self._verdicts_failed(e) from None

    def _last_good(self, but: int | None = None) -> str:
        """`but`: a step whose save failed or is still in flight (Orbax lists it already)."""
        good = [s for s in self.manager.all_steps() if s != but]
        trusted = self.trust.newest_trusted(good)
        newest = trusted if trusted is not None else max(good, default=None)
        return f"step {newest} in {self.directory}" if newest is not None else "none"

    def _prune(self) -> None:
        """Keeps the newest max_num_checkpoints_to_keep complete steps, the newest trusted one and `also_at`
        (a wsd run's last step at the peak, which an extension goes back to), called only after a save is known
        complete, so the step it supersedes is never deleted for one that may not exist."""
        keep = self.config.max_num_checkpoints_to_keep
        steps = sorted(self.manager.all_steps())
        trusted = self.trust.newest_trusted(steps)
        doomed = [s for s in (steps[:-keep] if keep else []) if s not in (trusted, self.also_at)]
        for step in doomed:
            self.manager.delete(step)
        held = set(self.manager.all_steps()) | set(self.local.steps() if self.local is not None else [])
        # verdicts of steps neither tier holds any more (older than all held: not a local save in flight)
        stale = [s for s in (*self.trust.trusted, *self.trust.rejected) if s < min(held, default=0)]
        if doomed or stale:
            self._forget([*doomed, *stale])

    def wait(self) -> None:
        """Blocks until the save in flight is durable (SaveError if it failed)."""
        self._confirm()

    def persisted(self, step: int) -> bool:
        return step in self.manager.all_steps()

    def close(self) -> None:
        """Waits until every save is durable; raises SaveError if the last one failed."""
        try:
            if self.local is not None:
                self._local_failed(self.local.wait())
            self._confirm()
        finally:
            self.manager.close()

    def restore(self, abstract_state, batches):
        """Goes back to the newest step, of either tier, that is not rejected and reads and verifies: returns
        the state and puts `batches` (the data iterator) back at its saved position; None if the run has no
        checkpoint. Says which step of which tier, and why (`resumed_line`). Unusable newer steps are
        reported and moved aside; if no step is usable, a CheckpointError lists why."""
        self._confirm()
        local = {}
        if self.local is not None:
            self._local_failed(self.local.wait())
            local = local_lib.holders(self.local)
        persistent = set(self.manager.all_steps())
        unusable, untrusted, local_unusable, stale = [], [], [], 0
        for step in sorted(persistent | set(local), reverse=True):
            if self.trust.verdict(step) == "rejected":
                untrusted.append(step)
                continue
            restored, tier = None, None
            if step in local:
                try:
                    restored, tier = self._restore_local(step, local[step], abstract_state), "local"
                except Corrupt as e:
                    local_unusable.append((step, str(e)))
                    stale += isinstance(e, local_lib.Stale)
            if restored is None and step in persistent:
                try:
                    restored, tier = self._restore_step(step, abstract_state) + ("",), "persistent"
                except Corrupt as e:
                    unusable.append((step, str(e)))
            if restored is None:
                continue
            state, data_state, peers = restored
            self._set_aside(untrusted, unusable, local_unusable, f"resuming from step {step} instead")
            try:
                batches.set_state(data_state)
            except Exception as e:  # saved by another kind of input pipeline
                raise CheckpointError(f"{self.directory / str(step)}: its data position {str(data_state)[:80]} does "
                                      f"not fit this config's data ({str(e) or type(e).__name__}); resume with the "
                                      f"data it was saved with, or use a new run_name") from None
            self.trust.resumed(step)
            self.resumed_line = self._resumed(step, tier == "local", persistent, local_unusable, peers)
            return state
        if unusable or len(local_unusable) > stale:
            why = "; ".join([*(f"step {s}: {w}" for s, w in unusable),
                             *(f"local step {s}: {w}" for s, w in local_unusable)])
            raise CheckpointError(f"{self.directory}: no usable checkpoint ({why}); move the directory away to "
                                  f"start afresh")
        self._set_aside(untrusted, [], local_unusable, "starting from the beginning")
        return None

    def _resumed(self, step: int, from_local: bool, persistent: set[int], local_unusable, peers: str) -> str:
        """The line that says what a start restored, from which tier, and why that one."""
        if self.local is None:
            return f"resumed from {self.directory}/{step}"
        newest = max(persistent, default=None)
        if from_local:
            where = self.local.root.parent / ("process_*" if jax.process_count() > 1 else self.local.root.name)
            why = ("the persistent tier holds it too; the local copy is faster to read" if step in persistent else
                   f"newer than the persistent tier's newest step, {newest}" if newest is not None else
                   "the persistent tier has no step yet")
            return f"resumed from step {step} of the local tier ({where}/{step}): {why}{peers}"
        why = "; ".join(f"the local tier's step {s} is unusable ({w})" for s, w in local_unusable) or \
            "the local tier holds no newer step"
        return f"resumed from step {step} of the persistent tier ({self.directory}/{step}): {why}"

    def _restore_local(self, step: int, holders: list[int], abstract_state):
        """(state, data position, a note on peers) from the local tier's `step`; Corrupt (the same on every
        process) if it cannot be had: missing or damaged on some processes whose shards no other process
        holds, another mesh, or a whole that does not match its digest."""
        me, meta, shards, why = jax.process_index(), None, None, "it has no copy"
        if me in holders:
            try:
                meta = self.local.read_meta(step)
                shards = self.local.read_shards(step, meta, abstract_state)
            except Corrupt as e:
                why, meta = str(e), None
        failing = _processes_failing(shards is not None)
        if len(failing) == jax.process_count():
            raise Corrupt(why if jax.process_count() == 1 else f"no process can read it (process {me}: {why})")
        meta = local_lib.share(meta, shards is not None)
        if meta["digest"].get("run") != self.run_identity():
            raise local_lib.Stale(f"written by an earlier run named {self.config.run_name} whose outputs are gone")
        where = f"{self.local.root.parent}: local step {step}"  # not damage: the config is another's
        check_model(meta["digest"].get("model", {}), self.config, where, f"; run_name={self.config.run_name} is "
                    "another model's run: choose another run_name, or leave it unset for one derived from the model")
        check_layout(meta["digest"]["leaves"], abstract_state, where, RESUME_HINT)
        state = local_lib.assemble(shards, abstract_state)
        if failing:
            state = local_lib.fill_from_replicas(state)
        try:
            verify(state, meta["digest"])
            if json_sha256(meta["data"]) != meta["digest"].get("data_sha256"):
                raise Corrupt("its data position does not match its checksum")
        except Corrupt as e:
            missing = f"processes {failing} could not read their copies and the mesh holds no replica of their " \
                      f"shards on another process; " if failing else ""
            raise Corrupt(f"{missing}{e}") from None
        if failing and shards is None and me in holders:
            self.local.set_aside(step, "unusable")  # damaged here: the state came from the peers
        peers = f"; process{'es' * (len(failing) > 1)} {', '.join(map(str, failing))} could not read {'their' if len(failing) > 1 else 'its'} " \
                f"copy ({why if me in failing else 'missing or damaged'}): the shards came from other processes' replicas" if failing else ""
        return state, meta["data"], peers

    def _set_aside(self, untrusted: list[int], unusable: list[tuple[int, str]], local_unusable, then: str) -> None:
        """Moves rejected and damaged newer steps out of the run (never deleted), one line for each kind."""
        say = print if jax.process_index() == 0 else (lambda *a, **k: None)
        persistent = set(self.manager.all_steps())
        if untrusted:
            reason = self.trust.rejected[untrusted[-1]]
            moved = [self._move_aside(s, "untrusted").name for s in untrusted if s in persistent]
            if self.local is not None:
                moved += [f"local {p.name}" for s in untrusted if (p := self.local.set_aside(s, "untrusted"))]
            many = len(untrusted) > 1
            say(f"warning: checkpoint{'s' * many} {', '.join(map(str, sorted(untrusted)))} in {self.directory} "
                f"{'are' if many else 'is'} not trusted (step {untrusted[-1]}: {reason}); {then} (kept aside as "
                f"{', '.join(sorted(moved))})", flush=True)
        for bad, why in unusable:
            moved = self._move_aside(bad)
            say(f"warning: checkpoint {self.directory / str(bad)} is unusable ({why}); {then} "
                f"(moved to {moved.name})", flush=True)
        for bad, why in local_unusable:
            self.local.set_aside(bad, "unusable")
            say(f"warning: local checkpoint {bad} ({self.local.root.parent}) is unusable ({why}); {then} (each "
                f"process's copy moved to {bad}.unusable)", flush=True)

    def set_aside_after(self, step: int, why: str, then: str) -> None:
        """Moves the steps after `step` out of the run (kept as `<step>.<why>`), if `step` is saved: the run
        resumes there (a wsd run extended goes back to its last step before the decay)."""
        steps = self.manager.all_steps()
        if step in steps and self.local is not None:
            self.local.drop_after(step)
        later = sorted(s for s in steps if s > step)
        if step not in steps or not later:
            return
        moved = [self._move_aside(s, why).name for s in later]
        if jax.process_index() == 0:
            print(f"{then}: resuming from step {step} (kept aside: {', '.join(moved)})", flush=True)

    def _restore_step(self, step: int, abstract_state):
        where = str(self.directory / str(step))
        meta, failure = self._restore_together(step, ocp.args.Composite(
            model=ocp.args.JsonRestore(), digest=ocp.args.JsonRestore()))
        # a missing, empty or garbled file: Orbax raises many types
        _agree(failure is None, f"cannot read its model description and digest: {type(failure).__name__}",
               "could not read its model description and digest")
        saved_model, record = meta["model"], meta["digest"]
        if not (isinstance(saved_model, dict) and isinstance(record, dict)
                and record.get("version") == DIGEST_VERSION):
            raise Corrupt("its model description or digest is not what maxtrain writes")
        check_model(saved_model, self.config, where, f"; run_name={self.config.run_name} is another model's run: "
                    "choose another run_name, or leave it unset for one derived from the model")  # not damage
        check_layout(record["leaves"], abstract_state, where, RESUME_HINT)
        restored, failure = self._restore_together(step, ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        _agree(failure is None, f"cannot read its state: {read_error_text(failure)}",
               "could not read its state")  # before verify(): its checksums are collectives
        ok, why = True, ""
        try:
            verify(restored["state"], record)
            if json_sha256(restored["data"]) != record.get("data_sha256"):
                raise Corrupt("its data position does not match its checksum")
        except Corrupt as e:
            ok, why = False, str(e)
        _agree(ok, why, "found it damaged")
        return restored["state"], restored["data"]

    def _restore_together(self, step: int, args) -> tuple[Any, Exception | None]:
        """Orbax's restore of `step`: (what it read, None) or (None, the error). Orbax ends a restore with a
        barrier of every process (a collective): a process whose own files fail to read raises before it,
        so it joins that barrier here, or the others wait in it while it goes on to the next collective."""
        try:
            return self.manager.restore(step, args=args), None
        except Exception as e:
            if jax.process_count() > 1:
                ocp.multihost.sync_global_processes(
                    ocp.multihost.unique_barrier_key("Checkpointer:restore", prefix=BARRIER_PREFIX))
            return None, e

    def _move_aside(self, step: int, why: str = "unusable") -> Path:
        target = self.directory / f"{step}.{why}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}.{why}{n}"
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(target)
        _sync(f"maxtrain_move_aside_{step}")
        self.manager.reload()  # reads every step's metadata: ...
        self._forget([step])
        _sync(f"maxtrain_moved_aside_{step}")  # ... so no step moves before every process has reloaded
        return target


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def incomplete_steps(directory: Path) -> list[Path]:
    """Leftovers of saves that never finished (Orbax's temporary step directories)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name)
