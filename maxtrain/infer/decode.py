"""Decoding with a KV cache: one prefill over a batch of prompts, then one position per step.

    engine = Engine(config, mesh)        # the decode model, for a resolved config and its mesh
    weights = engine.weights(params)     # a run's parameters as decoding runs them (each layer its own)
    out = engine.generate(weights, prompts, max_new_tokens, Sampling(...), eos_id)

Two compiled programs serve a call, whatever the prompts' lengths within a bucket (a power of two): the
prefill runs the prompts, left-padded to one length, through the training attention kernels, fills the
cache and picks each first token; the decode is a loop on the device (no host round trip per token)
that writes one slot per step for the whole batch and samples, STEPS_PER_CALL steps per call, until
every sequence has reached its eos or max_new_tokens.

Layers run unrolled, each from its own arrays: on XLA:CPU a step that slices a scanned stack's weights
copies them every step, which doubles the memory traffic that bounds a decode step. An MoE model routes
without a capacity limit (capacity_factor is a training device): each token gets its experts. Under
context parallelism the prefill splits the prompts' positions as training does, and the cache's slots
split over the context axis (the rule cache_length -> context).
"""

from __future__ import annotations

import dataclasses
import math
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from maxtrain.infer.kv_cache import KVCache, bytes_per_slot
from maxtrain.infer.sampling import Sampling
from maxtrain.models import quantization, registry, stacks as stacks_lib
from maxtrain.models.decoder import output_logits
from maxtrain.ops.attention import SPLASH
from maxtrain.observe import fit, summary
from maxtrain.parallel import mesh as mesh_lib, rules as rules_lib

# Prompts pad to a power of two of at least this many tokens (and a multiple of what the context axis and
# splash take): a few prefill programs serve every prompt length.
PROMPT_MULTIPLE = 16
STEPS_PER_CALL = 32  # decode steps per call of the decode program (the host checks for Ctrl-C between)


@dataclasses.dataclass
class Generated:
    ids: list[list[int]]  # each prompt's new ids, through its eos if it reached one
    prompt_tokens: int
    prefill_seconds: float
    decode_tokens: int    # tokens the decode steps produced (each sequence's first comes from the prefill)
    decode_seconds: float

    def speed(self) -> str:
        rate = lambda n, s: f"{n / s:,.1f} tokens/s" if s > 0 else "-"  # noqa: E731
        return (f"prefill: {self.prompt_tokens} tokens in {self.prefill_seconds:.2f} s "
                f"({rate(self.prompt_tokens, self.prefill_seconds)}) | decode: {self.decode_tokens} tokens in "
                f"{self.decode_seconds:.2f} s ({rate(self.decode_tokens, self.decode_seconds)})")


@dataclasses.dataclass(frozen=True)
class Shape:
    rows: int          # sequences per batch (a multiple of the batch's shards)
    prompt_slots: int  # the prompts' padded length
    new_tokens: int
    slots: int         # the cache's: the prompts and every new token but the last, padded like the prompts
    ring: int = 0      # every layer sliding: the last `ring` slots are a ring (kv_cache); slots = prompts + ring


class Engine:
    def __init__(self, c, mesh):
        # decoding's own model: layers unrolled, no remat (no gradient), dropless, positions in order
        dc = c.replace(scan_layers=False, remat_policy="none", capacity_factor=min(c.capacity_factor, -1.0),
                       context_parallel_load_balance=False)
        self.c, self.mesh, self.rules = dc, mesh, rules_lib.axis_rules(c)
        self.model = quantization.quantize(registry.spec_for(dc).build(dc), dc)
        self.args = registry.spec_for(dc).args(dc)
        probe = jnp.zeros((1, c.max_target_length), jnp.int32)  # a length every attention kernel takes
        boxed = jax.eval_shape(self.model.init, jax.random.key(0), probe)["params"]
        self.param_shapes = jax.tree.map(lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x, boxed,
                                         is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
        self.param_shardings = rules_lib.param_shardings(nn.get_partition_spec(boxed), self.param_shapes, mesh,
                                                         self.rules)
        self.batch_shards = rules_lib.shards(self.rules, "batch", c.mesh_shape)
        seq_shards = rules_lib.sequence_shards(c.logical_axis_rules, c.mesh_shape)
        self.multiple = math.lcm(PROMPT_MULTIPLE, seq_shards * (128 if c.attention in SPLASH else 1))
        self._compiled: dict = {}

    # ---- the parameters as decoding runs them

    def weights(self, params, own: bool = False):
        """`params` in the run's layout (scanned stacks or not, model order) as decoding runs them: each
        layer its own arrays, in the decode model's shardings. `own`: each stacked array is deleted once
        split (the peak is one stacked array more than the model; else a second copy of the model)."""
        target = traverse_util.flatten_dict(self.param_shardings)
        stacks = {s.name: s for s in stacks_lib.for_keys(self.c)}
        out = {}
        for path, x in traverse_util.flatten_dict(params).items():
            if x.sharding.memory_kind == "pinned_host":  # a host-offloaded run's weights: a copy in for decoding
                x = jax.device_put(x, rules_lib.in_device_memory(x.sharding))
            if path in target:
                out[path] = jax.device_put(x, target[path])
                continue
            stack = stacks[path[0]]
            if stack.period == 1:
                paths = [(stacks_lib.unrolled(i), *path[1:]) for i in stack.layers]
            else:  # an interleaved stack: path[1] is the position in the period
                layers = dict((sub, layers) for sub, _, layers in stack.positions())[path[1]]
                paths = [(stacks_lib.unrolled(i), *path[2:]) for i in layers]
            split = jax.jit(lambda x: tuple(x[i] for i in range(x.shape[0])),
                            out_shardings=tuple(target[p] for p in paths))
            out.update(zip(paths, split(x)))
            if own:
                x.delete()
        return traverse_util.unflatten_dict(out)

    # ---- the programs

    def prefill(self, weights, tokens_BxP, start_B, slots: int, ring: int = 0):
        """(logits [B,V] float32 of each prompt's last position, the cache with the prompts written).
        Prompts are left-padded: sequence b starts at slot start_B[b]."""
        cache = KVCache.empty(self.args, start_B, slots, ring)
        slots_P = jnp.arange(tokens_BxP.shape[1])
        positions_BxP = jnp.maximum(slots_P - start_B[:, None], 0)
        segment_ids_BxP = (slots_P >= start_B[:, None]).astype(jnp.int32)  # padding: a document of its own
        return self._logits(weights, tokens_BxP, positions_BxP, segment_ids_BxP, cache)

    def step(self, weights, tokens_Bx1, cache):
        """(logits [B,V] float32 after each sequence's next token, the cache with it written)."""
        return self._logits(weights, tokens_Bx1, cache.positions(1), jnp.ones_like(tokens_Bx1), cache)

    def _logits(self, weights, tokens_BxL, positions_BxL, segment_ids_BxL, cache):
        (hidden_BxLxD, out_DxV), cache = self.model.apply({"params": weights}, tokens_BxL, positions_BxL,
                                                          segment_ids_BxL, return_hidden=True, cache=cache)
        logits_BxV = output_logits(hidden_BxLxD[:, -1:], out_DxV, self.args.logits_dot_in_fp32,
                                  self.args.vocab.logit_softcap)[:, 0]
        return logits_BxV[:, :self.args.vocab.size], cache  # not the padding

    def _first(self, weights, tokens_BxP, start_B, numbers_B, live_B, *, shape: Shape, sampling: Sampling,
               eos: int):
        """The prefill and each sequence's first new token: (ids [B, new_tokens], which sequences are done,
        the cache)."""
        logits_BxV, cache = self.prefill(weights, tokens_BxP, start_B, shape.slots, shape.ring)
        first_B = sampling.choose(logits_BxV, sampling.row_keys(numbers_B), 0)
        tokens_BxT = jnp.zeros((first_B.shape[0], shape.new_tokens), jnp.int32).at[:, 0].set(first_B)
        return tokens_BxT, ~live_B | (first_B == eos), cache

    def _decode(self, weights, cache, tokens_BxT, done_B, step, numbers_B, *, shape: Shape, sampling: Sampling,
                eos: int):
        """Up to STEPS_PER_CALL decode steps from `step`, while a sequence is not done: (ids, done, the next
        step, the cache). After its eos a sequence's ids are zeros."""
        keys_B = sampling.row_keys(numbers_B)
        stop = jnp.minimum(step + STEPS_PER_CALL, shape.new_tokens)

        def more(carry):
            step, _, _, done_B = carry
            return (step < stop) & ~jnp.all(done_B)

        def decode_one(carry):
            step, cache, tokens_BxT, done_B = carry
            logits_BxV, cache = self.step(weights, jax.lax.dynamic_slice_in_dim(tokens_BxT, step - 1, 1, axis=1), cache)
            new_B = jnp.where(done_B, 0, sampling.choose(logits_BxV, keys_B, step))
            tokens_BxT = jax.lax.dynamic_update_slice(tokens_BxT, new_B[:, None], (0, step))
            return step + 1, cache, tokens_BxT, done_B | (new_B == eos)

        step, cache, tokens_BxT, done_B = jax.lax.while_loop(more, decode_one, (step, cache, tokens_BxT, done_B))
        return tokens_BxT, done_B, step, cache

    def compile(self, shape: Shape, sampling: Sampling, eos: int):
        """(prefill, decode) compiled for `shape`, once per engine; checked against a device's memory."""
        key = (shape, sampling, eos)
        if key not in self._compiled:
            with mesh_lib.activate(self.mesh, self.rules):
                self._compiled[key] = self._compile(shape, sampling, eos)
        return self._compiled[key]

    def _compile(self, shape: Shape, sampling: Sampling, eos: int):
        sharding = lambda axes, dims: rules_lib.sharding_for(axes, self.mesh, self.rules, dims)  # noqa: E731
        rows = (shape.rows,)
        weights = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.param_shardings,
                               self.param_shapes)
        tokens = jax.ShapeDtypeStruct((shape.rows, shape.prompt_slots), jnp.int32,
                                      sharding=sharding(("batch", "length"), (shape.rows, shape.prompt_slots)))
        per_row = lambda dtype: jax.ShapeDtypeStruct(rows, dtype, sharding=sharding(("batch",), rows))  # noqa: E731
        replicated = rules_lib.replicated(self.mesh)  # what the host reads between calls: every process whole
        keywords = dict(shape=shape, sampling=sampling, eos=eos)
        first = jax.jit(lambda *a: self._first(*a, **keywords), out_shardings=(replicated, replicated, None))
        first = first.lower(weights, tokens, per_row(jnp.int32), per_row(jnp.int32), per_row(jnp.bool_)).compile()
        ids, done, cache = first.out_info
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        decode = jax.jit(lambda *a: self._decode(*a, **keywords), donate_argnums=(1, 2, 3),
                         out_shardings=(replicated, replicated, replicated, jax.tree.map(lambda x: x.sharding, cache)))
        decode = decode.lower(weights, cache, ids, done, step, per_row(jnp.int32)).compile()
        self._check_memory(shape, first, decode)
        return first, decode

    def cache_gib(self, shape: Shape) -> float:
        """The KV cache's GiB per device (the rows split over the batch's shards)."""
        per_slot = bytes_per_slot(self.args)
        return self.args.layers * shape.rows * shape.slots * per_slot / self.batch_shards / fit.GiB

    def _check_memory(self, shape: Shape, *programs) -> None:
        need = max(summary.memory_report(p)["total"] for p in programs) * fit.GiB
        have, source = fit.device_memory(self.mesh.devices.flat[0])
        if need > have:
            raise fit.FitError(
                f"max_new_tokens: {shape.new_tokens} after prompts of up to {shape.prompt_slots} tokens, "
                f"{shape.rows} at a time, makes a KV cache of {shape.slots} slots ({self.cache_gib(shape):.2f} GiB per device), "
                f"and decoding needs {need / fit.GiB:.2f} GiB per device, more than the {have / fit.GiB:.2f} GiB "
                f"a device has ({source}); lower max_new_tokens or generate_batch_size")

    # ---- a call

    def shape(self, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> Shape:
        rows = -(-min(batch_size, len(prompts)) // self.batch_shards) * self.batch_shards
        pad = lambda n: -(-n // self.multiple) * self.multiple  # noqa: E731  (the context axis splits both)
        prompt_slots = pad(max(PROMPT_MULTIPLE, 1 << (max(map(len, prompts)) - 1).bit_length()))
        slots = pad(prompt_slots + max_new_tokens - 1)
        window = self.args.attention.window
        ring = pad(window.size) if window and window.every_layer else 0
        if ring and prompt_slots + ring < slots:  # every layer slides: the window bounds the cache
            return Shape(rows, prompt_slots, max_new_tokens, prompt_slots + ring, ring)
        return Shape(rows, prompt_slots, max_new_tokens, slots)

    def generate(self, weights, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
                 eos_id: int | None = None, batch_size: int = 1) -> Generated:
        """Each prompt's new ids (stopping after eos_id), batch_size prompts at a time. Call under the mesh."""
        shape = self.shape(prompts, max_new_tokens, batch_size)
        first, decode = self.compile(shape, sampling, -1 if eos_id is None else eos_id)
        out = Generated([], sum(map(len, prompts)), 0.0, 0, 0.0)
        per_batch = min(batch_size, shape.rows)
        for begin in range(0, len(prompts), per_batch):
            batch = prompts[begin:begin + per_batch]
            tokens, start, numbers, live = self._batch(batch, begin, shape)
            t0 = time.perf_counter()
            tokens_BxT, done_B, cache = first(weights, tokens, start, numbers, live)
            step, steps, all_done = self._put(np.asarray(1, np.int32), ()), 1, bool(np.all(np.asarray(done_B)))
            t1 = time.perf_counter()
            while steps < max_new_tokens and not all_done:  # back on the host every few steps: Ctrl-C lands
                tokens_BxT, done_B, step, cache = decode(weights, cache, tokens_BxT, done_B, step, numbers)
                steps, all_done = int(step), bool(np.all(np.asarray(done_B)))
            tokens_BxT = np.asarray(tokens_BxT)
            out.prefill_seconds += t1 - t0
            out.decode_seconds += time.perf_counter() - t1
            for row in tokens_BxT[:len(batch), :steps].tolist():
                ids = row[:row.index(eos_id) + 1] if eos_id in row else row
                out.ids.append(ids)
                out.decode_tokens += len(ids) - 1
        return out

    def _put(self, x: np.ndarray, axes: tuple):
        """A host array every process holds whole, as a global array split as `axes` say."""
        sharding = rules_lib.sharding_for(axes, self.mesh, self.rules, x.shape)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def _batch(self, prompts: list[list[int]], first_number: int, shape: Shape):
        """The device arrays of one batch: prompts left-padded (unused rows copy the first prompt, and
        are not live), their first slots, their numbers (sampling keys), which rows are live."""
        tokens = np.zeros((shape.rows, shape.prompt_slots), np.int32)
        start = np.zeros(shape.rows, np.int32)
        for b in range(shape.rows):
            ids = prompts[b] if b < len(prompts) else prompts[0]
            tokens[b, shape.prompt_slots - len(ids):] = ids
            start[b] = shape.prompt_slots - len(ids)
        numbers = np.arange(first_number, first_number + shape.rows, dtype=np.int32)
        live = np.arange(shape.rows) < len(prompts)
        return (self._put(tokens, ("batch", "length")), self._put(start, ("batch",)), self._put(numbers, ("batch",)),
                self._put(live, ("batch",)))
