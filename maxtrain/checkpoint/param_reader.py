"""A maxtrain checkpoint step's parameters, read one subtree at a time as host numpy arrays and checked
against the step's digest as they are read: export (maxtrain.convert) never holds the whole model."""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtrain.checkpoint import digest as digest_lib, loading as ckpt_loading, manager as ckpt_lib
from maxtrain.checkpoint.describe import as_written_now


class _QuietStepMetadata(logging.Filter):
    """Orbax warns that a step's state/ lacks the metadata file its CheckpointManager keeps one level up."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Metadata file does not exist")


logging.getLogger("absl").addFilter(_QuietStepMetadata())


def get_path(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


class CheckpointParams:
    """The parameters of a maxtrain checkpoint step directory, restored one subtree at a time as host
    numpy arrays: export never holds the whole model (an unscanned layer, or one stacked parameter)."""

    def __init__(self, checkpoint: str):
        import orbax.checkpoint as ocp
        self._ocp = ocp
        self.step_dir = ckpt_loading.step_directory(checkpoint, "--checkpoint")
        saved = ckpt_loading.read_model(self.step_dir, "--checkpoint")
        self.signature = as_written_now(saved)  # (as checkpoint.check_model reads it)
        self._checkpointer = ocp.PyTreeCheckpointer()
        try:
            self.metadata = self._checkpointer.metadata(self.step_dir / "state").item_metadata.tree["params"]
        except Exception as e:  # Orbax raises many types for unreadable data
            raise ckpt_loading.restore_failed("--checkpoint", self.step_dir, e) from None
        # A training run's step has a digest (parameters written by hf_to_maxtrain have none): each
        # parameter is checked against it as it is read, as a restore would check the whole state.
        self.record = ckpt_loading.read_digest(self.step_dir, "--checkpoint")
        cpu = jax.local_devices(backend="cpu")[:1]
        self._on_cpu = NamedSharding(Mesh(np.array(cpu), ("host",)), PartitionSpec())

    def read(self, *path: str):
        nested = get_path(self.metadata, path)
        for key in reversed(path):
            nested = {key: nested}
        target = {"params": nested}
        restore_args = jax.tree.map(lambda _: self._ocp.RestoreArgs(restore_type=np.ndarray), target)
        try:
            restored = self._checkpointer.restore(self.step_dir / "state", args=self._ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True))
        except Exception as e:
            raise ckpt_loading.restore_failed("--checkpoint", self.step_dir, e) from None
        self._verify(restored["params"])
        return get_path(restored["params"], path)

    def _verify(self, params) -> None:
        """Every array just read against the step's digest: same checksums, all finite (a saved state is)."""
        if self.record is None:
            return
        try:
            digest_lib.verify(jax.device_put(params, self._on_cpu), self.record, ".params")
        except (digest_lib.Corrupt, TypeError, ValueError) as e:
            raise ckpt_lib.CheckpointError(f"--checkpoint: {self.step_dir} does not match its digest ({e}): the "
                                           f"checkpoint is damaged; nothing written") from None
