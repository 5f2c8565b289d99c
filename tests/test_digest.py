"""State digests: the same on any mesh, changed by any flipped bit or swapped pair, dtype-aware."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtrain.checkpoint.digest import Corrupt, digest, verify


def tree_on(devices, spec, values):
    mesh = Mesh(np.array(devices), ("fsdp",))
    return {k: jax.device_put(v, NamedSharding(mesh, spec if v.ndim else PartitionSpec()))
            for k, v in values.items()}


VALUES = {
    "w": np.random.default_rng(0).standard_normal((16, 24)).astype(np.float32),
    "b": np.random.default_rng(1).standard_normal((16, 8)).astype(jnp.bfloat16),
    "step": np.array(7, np.int32),
}


def test_the_same_on_any_mesh():
    one = digest(tree_on(jax.devices()[:1], PartitionSpec(), VALUES))
    eight = digest(tree_on(jax.devices()[:8], PartitionSpec("fsdp"), VALUES))
    assert one == eight and one[1] is True
    assert [e[:3] for e in one[0]] == [["['b']", [16, 8], "bfloat16"], ["['step']", [], "int32"],
                                       ["['w']", [16, 24], "float32"]]


@pytest.mark.parametrize("key, index, bit", [("w", (0, 0), 0), ("w", (15, 23), 31), ("w", (7, 3), 12),
                                             ("b", (3, 5), 15), ("step", (), 0)])
def test_any_flipped_bit_is_detected(key, index, bit):
    devices = jax.devices()[:8]
    saved = {"leaves": digest(tree_on(devices, PartitionSpec("fsdp"), VALUES))[0]}
    damaged = {k: v.copy() for k, v in VALUES.items()}
    raw = damaged[key].view(np.uint32 if damaged[key].itemsize == 4 else np.uint16)
    raw[index] ^= type(raw[index])(1 << bit)
    with pytest.raises(Corrupt, match="differ from their checksums"):
        verify(tree_on(devices, PartitionSpec("fsdp"), damaged), saved)
    verify(tree_on(devices, PartitionSpec("fsdp"), VALUES), saved)  # the intact tree passes


def test_swapped_values_and_non_finite_values_are_detected():
    devices = jax.devices()[:8]
    saved = {"leaves": digest(tree_on(devices, PartitionSpec("fsdp"), VALUES))[0]}
    swapped = {**VALUES, "w": VALUES["w"][::-1].copy()}  # same bits, other places: only the weighted sum sees it
    with pytest.raises(Corrupt):
        verify(tree_on(devices, PartitionSpec("fsdp"), swapped), saved)
    nan = {**VALUES, "w": np.full_like(VALUES["w"], np.nan)}
    entries, finite = digest(tree_on(devices, PartitionSpec("fsdp"), nan))
    assert finite is False
    with pytest.raises(Corrupt, match="non-finite"):
        verify(tree_on(devices, PartitionSpec("fsdp"), nan), {"leaves": entries})
