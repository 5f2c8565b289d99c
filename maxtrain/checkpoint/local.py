"""The local tier: every `local_checkpoint_period` steps each process writes the shards of the train state it
holds, with the data position and the state's digest, to its own disk (a RAM disk or local SSD), under
`<local_checkpoint_directory>/<run_name>/process_<i>/<step>/`. No process waits for another to save, and a
save costs a copy to host memory; the write runs on a thread.

A step directory holds `shards.bin` (each unique shard's bytes, one after another) and `index.json` (the
mesh it was written on; per array its shards' places, dtype, offset and CRC-32; the data position; the
digest), written last: a directory without it is a save cut short and is never read. A write goes to
`<step>.partial` and is renamed when complete.

Reading it back needs the same mesh (device count and order). A process whose copy is missing or damaged
(a replaced host) gets its shards from another process's replica where the mesh has one (data-parallel
replicas across processes): every process puts what it read, or zeros, on its devices, and a max over the
replicated mesh axes of the arrays' bits fills the gaps bit for bit. The state's digest (digest.py) then
checks the whole, as for the persistent tier. Which step of which tier a start restores is manager.py's.

Why not Orbax's emergency CheckpointManager: it saves a single PyTree (not the data position and digest
with it), treats a whole slice as the replica it broadcasts from, and its restore bypasses what makes our
checkpoints trustworthy (digests, trusted and rejected steps). See docs/checkpoints.md.
"""

from __future__ import annotations

import json
import shutil
import threading
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from maxtrain.checkpoint.describe import os_error_text
from maxtrain.checkpoint.digest import Corrupt
from maxtrain.parallel import rules


class Stale(Corrupt):
    """A local copy of an earlier run of the same name (its outputs deleted): passed over, not an error."""

FORMAT = 1
INDEX, DATA = "index.json", "shards.bin"
KEEP = 2          # newest local steps kept (a damaged newest one has a fallback)
LISTED = 16       # local steps each process reports when the processes agree on what they hold


def _place(index: tuple, shape) -> list[list[int]]:
    """A shard's place in its array, as [start, stop] per dimension."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


def _unique_shards(x: jax.Array) -> list[tuple[list, np.ndarray]]:
    """This process's shards of `x`, each place once (devices of a process can hold the same place). On an
    accelerator np.asarray copies to the host; on CPU it is a view, and the view keeps the buffer: JAX then
    does not donate it to the next step (the write reads the state as saved)."""
    seen, out = set(), []
    for shard in x.addressable_shards:
        place = _place(shard.index, x.shape)
        key = json.dumps(place)
        if key not in seen:
            seen.add(key)
            out.append((place, np.asarray(shard.data)))
    return out


def _mesh_record(state) -> dict:
    mesh = jax.tree.leaves(state)[0].sharding.mesh
    return {"axes": list(mesh.axis_names), "shape": list(mesh.devices.shape),
            "devices": [int(d.id) for d in mesh.devices.flat], "processes": jax.process_count()}


class LocalTier:
    def __init__(self, directory: Path, run_name: str, period: int):
        self.root = Path(directory) / run_name / f"process_{jax.process_index()}"
        self.period = period
        self.failed: str | None = None   # why this process stopped writing its local copies
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.root.mkdir(parents=True, exist_ok=True)  # the caller turns an OSError into a config error
        for leftover in self.root.glob("*.partial"):  # a save cut short by a kill
            shutil.rmtree(leftover, ignore_errors=True)

    def due(self, step: int) -> bool:
        return step % self.period == 0

    def steps(self) -> list[int]:
        """This process's complete local steps, newest last."""
        try:
            return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and (p / INDEX).is_file())
        except OSError:
            return []

    # -- saving ----------------------------------------------------------------------------------------

    def save(self, step: int, state, data_state, record: dict, keep: set[int]) -> None:
        """Copies this process's shards to host memory now and writes them on a thread; `keep`: steps that
        retention spares (the newest trusted one)."""
        self.wait()
        if self.failed is not None:
            return
        leaves = jax.tree_util.tree_leaves_with_path(state)
        for _, x in leaves:
            x.copy_to_host_async()  # every transfer under way at once, then each one read
        arrays = [(jax.tree_util.keystr(path), str(x.dtype), list(x.shape), _unique_shards(x)) for path, x in leaves]
        meta = {"format": FORMAT, "step": step, "mesh": _mesh_record(state), "data": data_state, "digest": record}
        self._thread = threading.Thread(target=self._write, args=(step, arrays, meta, keep), daemon=True,
                                        name=f"maxtrain-local-save-{step}")
        self._thread.start()

    def _write(self, step: int, arrays, meta: dict, keep: set[int]) -> None:
        try:
            partial = self.root / f"{step}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            entries, offset = [], 0
            with open(partial / DATA, "wb") as f:
                for path, dtype, shape, shards in arrays:
                    for place, data in shards:
                        raw = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))  # no copy
                        f.write(raw)
                        entries.append({"path": path, "dtype": dtype, "shape": shape, "place": place,
                                        "offset": offset, "bytes": raw.nbytes, "crc32": zlib.crc32(raw)})
                        offset += raw.nbytes
            (partial / INDEX).write_text(json.dumps(meta | {"shards": entries}))
            target = self.root / str(step)
            if target.exists():  # a step saved again (after a rollback or a resume from an older step)
                shutil.rmtree(target)
            partial.rename(target)
            kept = self.steps()[-KEEP:]
            for old in self.steps()[:-KEEP]:
                if old not in keep:
                    shutil.rmtree(self.root / str(old), ignore_errors=True)
            for aside in self.root.glob("*.*"):  # copies set aside (damaged, rejected): the disk is small
                if aside.name.split(".")[0].isdigit() and int(aside.name.split(".")[0]) < kept[0]:
                    shutil.rmtree(aside, ignore_errors=True)
        except BaseException as e:  # noqa: BLE001 (reported by wait(), in the loop's thread)
            shutil.rmtree(self.root / f"{step}.partial", ignore_errors=True)
            self._error = e

    def writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> str | None:
        """Waits for the write in flight. A write that failed (a full RAM disk) stops this process's local
        saves for the rest of the run; returns the reason, once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is None:
            return None
        e, self._error = self._error, None
        self.failed = os_error_text(e)
        return self.failed

    # -- reading ---------------------------------------------------------------------------------------

    def read_meta(self, step: int) -> dict:
        try:
            meta = json.loads((self.root / str(step) / INDEX).read_text())
        except (OSError, ValueError) as e:
            raise Corrupt(f"cannot read its index: {type(e).__name__}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("shards"), list):
            raise Corrupt("its index is not what maxtrain writes")
        return meta

    def read_shards(self, step: int, meta: dict, abstract_state) -> dict[tuple[str, str], np.ndarray]:
        """This process's shards of `step`, checked against their CRC-32s: {(array path, place): data}."""
        if meta["mesh"] != _mesh_record(abstract_state):
            m = meta["mesh"]
            raise Corrupt(f"written on another mesh ({m.get('processes')} processes, mesh {m.get('shape')})")
        out = {}
        try:
            with open(self.root / str(step) / DATA, "rb") as f:
                for e in meta["shards"]:
                    f.seek(e["offset"])
                    raw = np.fromfile(f, np.uint8, e["bytes"])  # writable and aligned: a CPU device can alias it
                    if raw.nbytes != e["bytes"]:
                        raise Corrupt(f"{DATA} ends before {e['path']}'s bytes (truncated)")
                    if zlib.crc32(raw) != e["crc32"]:
                        raise Corrupt(f"{e['path']}: its bytes do not match their CRC-32")
                    shape = [b - a for a, b in e["place"]]
                    out[(e["path"], json.dumps(e["place"]))] = raw.view(jnp.dtype(e["dtype"])).reshape(shape)
        except OSError as e:
            raise Corrupt(f"cannot read its shards: {type(e).__name__}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise Corrupt(f"its index is damaged ({type(e).__name__})") from None
        return out

    def set_aside(self, step: int, why: str) -> Path | None:
        """Moves this process's copy of `step` out of the tier (kept as `<step>.<why>`)."""
        source = self.root / str(step)
        if not source.exists():
            return None
        target, n = self.root / f"{step}.{why}", 1
        while target.exists():
            n += 1
            target = self.root / f"{step}.{why}{n}"
        source.rename(target)
        return target

    def drop_after(self, step: int) -> None:
        """A wsd run extended goes on from `step`: the later local copies are the old end's."""
        for s in self.steps():
            if s > step:
                self.set_aside(s, "decayed")


def assemble(shards: dict | None, abstract_state):
    """The global state from every process's shards; a process without them (None, or a place it lacks)
    puts zeros, which fill_from_replicas() replaces."""
    def leaf(path, a):
        name = jax.tree_util.keystr(path)
        arrays = []
        for device, index in a.sharding.addressable_devices_indices_map(a.shape).items():
            place = json.dumps(_place(index, a.shape))
            data = shards.get((name, place)) if shards is not None else None
            if data is None:
                data = np.zeros([b - a_ for a_, b in _place(index, a.shape)], a.dtype)
            kind = a.sharding.memory_kind  # pinned_host for a host-offloaded state
            arrays.append(jax.device_put(data, jax.sharding.SingleDeviceSharding(device, memory_kind=kind)))
        return jax.make_array_from_single_device_arrays(a.shape, a.sharding, arrays)
    return jax.tree_util.tree_map_with_path(leaf, abstract_state)


def _replicated_axes(sharding) -> tuple[str, ...]:
    used = set()
    for entry in sharding.spec:
        used.update(entry if isinstance(entry, tuple) else (entry,) if entry else ())
    return tuple(a for a in sharding.mesh.axis_names if a not in used)


def fill_from_replicas(state):
    """Each array's bits, maxed over the mesh axes it is replicated on: where every replica but some hold
    zeros (a process without its copy), all get the copy, bit for bit (the copies are equal)."""
    def fill(x, sharding):
        axes = _replicated_axes(sharding)
        if not axes:
            return x
        spec = PartitionSpec(*sharding.spec)
        uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]

        def block_max(block):
            if block.dtype == jnp.bool_:
                return jax.lax.pmax(block.astype(jnp.uint8), axes).astype(jnp.bool_)
            bits = jax.lax.pmax(jax.lax.bitcast_convert_type(block, uint), axes)
            return jax.lax.bitcast_convert_type(bits, block.dtype)
        return jax.shard_map(block_max, mesh=sharding.mesh, in_specs=spec, out_specs=spec)(x)
    leaves, tree = jax.tree.flatten(state)
    shardings = [x.sharding for x in leaves]
    on_device = rules.in_device_memory(shardings)  # a host-offloaded state: computed in device memory
    filled = jax.jit(lambda xs: [fill(x, s) for x, s in zip(jax.device_put(xs, on_device), shardings)],
                     out_shardings=shardings)(leaves)
    return jax.tree.unflatten(tree, filled)


def share(value, have: bool):
    """`value` (JSON) from the lowest process that has it, on every process; some process must have it."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    raw = json.dumps(value).encode() if have else b""
    lengths = np.asarray(multihost_utils.process_allgather(np.array(len(raw) if have else -1, np.int32))).reshape(-1)
    source = int(np.argmax(lengths >= 0))
    buffer = np.frombuffer(raw, np.uint8) if jax.process_index() == source else np.zeros(int(lengths[source]), np.uint8)
    out = multihost_utils.broadcast_one_to_all(buffer, is_source=jax.process_index() == source)
    return json.loads(bytes(np.asarray(out)))


def holders(tier: "LocalTier | None") -> dict[int, list[int]]:
    """Every local step some process holds, and which processes hold it (the same answer on every process)."""
    mine = tier.steps()[-LISTED:] if tier is not None else []
    row = np.array(mine + [-1] * (LISTED - len(mine)), np.int32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        rows = np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), LISTED)
    else:
        rows = row[None]
    out: dict[int, list[int]] = {}
    for process, steps in enumerate(rows):
        for s in steps[steps >= 0]:
            out.setdefault(int(s), []).append(process)
    return out
