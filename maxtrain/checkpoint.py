"""Orbax checkpoints: train state, data-iterator state and model shape, saved together, async.

Layout: base_output_directory/run_name/checkpoints/<step>/{state,data,model}. Orbax writes each step
into a temporary directory and renames it when complete, so a save cut short by a kill is never
listed as a step; we warn about such leftovers and resume from the latest complete step.

Start-up order (as MaxText): resume this run's latest checkpoint; else load_full_state_path;
else load_parameters_path (fresh optimizer); else fresh init.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from maxtrain.config import MODEL_KEYS, Config
from maxtrain.errors import UserError

log = logging.getLogger("maxtrain")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used as asked; the CLI prints it as one line and exits 2."""
    kind = "checkpoint"


def model_signature(c: Config) -> dict[str, Any]:
    return {k: c[k] for k in MODEL_KEYS} | {"scan_layers": c.scan_layers}


def check_model(saved: dict[str, Any], c: Config, where: str) -> None:
    ours = model_signature(c)
    diff = [f"{k} (checkpoint {saved.get(k)!r}, config {ours[k]!r})" for k in ours if saved.get(k) != ours[k]]
    if diff:
        raise CheckpointError(f"{where}: model shape differs: {'; '.join(diff)}")


def incomplete_steps(directory: Path) -> list[Path]:
    """Leftovers of saves that never finished (Orbax's temporary step directories)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name)


class Checkpointer:
    def __init__(self, c: Config):
        self.config = c
        self.directory = Path(c.base_output_directory).absolute() / c.run_name / "checkpoints"
        for leftover in incomplete_steps(self.directory):
            log.warning("ignoring incomplete checkpoint %s (a save was interrupted)", leftover)
            print(f"warning: ignoring incomplete checkpoint {leftover.name} (a save was interrupted)")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=c.max_num_checkpoints_to_keep or None,
            enable_async_checkpointing=c.async_checkpointing,
            cleanup_tmp_directories=True,
            create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", "model"))

    def due(self, step: int) -> bool:
        """Every checkpoint_period steps. (Orbax's own schedule would also save a run's first step.)"""
        return step % self.config.checkpoint_period == 0

    def save(self, step: int, state, data_state: dict) -> None:
        """Starts saving `step` (the loop decides when); returns once device buffers are copied."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state),
                                  model=ocp.args.JsonSave(model_signature(self.config)))
        self.manager.save(step, args=args, force=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def restore(self, abstract_state, batches):
        """Resume this run from its latest complete step: returns the state and puts `batches` (the data
        iterator) back at its saved position; None if the run has no checkpoint."""
        step = self.latest_step()
        if step is None:
            return None
        where = str(self.directory / str(step))
        saved_model = self.manager.restore(step, args=ocp.args.Composite(model=ocp.args.JsonRestore()))["model"]
        check_model(saved_model, self.config, where)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except Exception as e:  # e.g. another optimizer or dtype: the saved tree does not fit this state
            raise CheckpointError(f"{where}: cannot resume this run with this config ({type(e).__name__}: "
                                  f"{first_line(e)}); a config that changes the train state needs a new "
                                  f"run_name") from None
        try:
            batches.set_state(restored["data"])
        except Exception as e:  # saved by another kind of input pipeline
            raise CheckpointError(f"{where}: its data position {str(restored['data'])[:80]} does not fit this "
                                  f"config's {self.config.dataset_type} data ({type(e).__name__}); resume with "
                                  f"the data it was saved with, or use a new run_name") from None
        return restored["state"]


def step_directory(path: str, key: str) -> Path:
    p = Path(path).absolute()
    if not (p / "state").is_dir():
        raise CheckpointError(f"{key}: {p} is not a maxtrain checkpoint step directory "
                              f"(expected {p}/state; e.g. <run>/checkpoints/<step>)")
    if (p / "model").is_dir():
        return p
    raise CheckpointError(f"{key}: {p} has no model description (expected {p}/model)")


def first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def restore_failed(key: str, p: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"{key}: cannot restore {p}/state: {type(e).__name__}: {first_line(e)}")


def read_model(p: Path) -> dict:
    return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(p / "model")


def load_full_state(c: Config, abstract_state):
    """State (params, optimizer, step) from another run's checkpoint step directory."""
    p = step_directory(c.load_full_state_path, "load_full_state_path")
    check_model(read_model(p), c, str(p))
    try:
        return ocp.StandardCheckpointer().restore(p / "state", abstract_state)
    except Exception as e:  # Orbax raises many types for unreadable data
        raise restore_failed("load_full_state_path", p, e) from None


def load_parameters(c: Config, abstract_params):
    """Parameters only (from a full-state or a parameters-only checkpoint); optimizer starts fresh."""
    p = step_directory(c.load_parameters_path, "load_parameters_path")
    check_model(read_model(p), c, str(p))
    target = {"params": abstract_params}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape,
                                                               dtype=x.dtype), target)
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            p / "state", args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                                     partial_restore=True))
    except Exception as e:
        raise restore_failed("load_parameters_path", p, e) from None
    return restored["params"]


def save_parameters(path: str | Path, params, c: Config) -> None:
    """A parameters-only checkpoint step directory that load_parameters_path accepts."""
    p = Path(path).absolute()
    # Synchronous, at most 1 GB of encoded data in flight: converting a model needs little more than it.
    saver = ocp.Checkpointer(ocp.StandardCheckpointHandler(save_concurrent_gb=1))
    saver.save(p / "state", args=ocp.args.StandardSave({"params": params}))
    ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(p / "model", model_signature(c))
