"""The KV cache: every layer's keys and values of the sequences being decoded, written once per position.

Layout. Each layer holds keys and values as [R, S, K]: R = B x N rows, one per (sequence, kv head) pair,
S slots, K the head dim; the cache is in the compute dtype. Multi-head latent attention (maxtrain.models.mla)
keeps one row per sequence: as keys its rotary key part, as values its latent (`layout`). Rows rather than [B, N, S, K] because
XLA:CPU updates the cache in place and feeds it to the attention matmul only when the matmul takes the
updated array as it is: with one sequence, [1, N, S, K] needs a reshape between them, and XLA then
copies the whole cache, twice per layer and step (seen in the compiled program). The rows split over
the batch's mesh axes and then the kv heads' (together, exactly as the two dimensions would split), the
slots over the rules' `cache_length` axes (context by default: each device scores its share of the
slots, and the softmax's sums are reduced across them), the head dim as `head_dim`.

Memory: 2 (keys and values) x N x K x bytes per element, per slot, per layer, per sequence (MLA: its
qk_rope_head_dim + kv_lora_rank elements).

Left padding. Prompts end at the same slot: sequence b fills slots start_b .. P-1, so every decode step
writes all sequences at one slot (`index`), and the position of slot j in sequence b is j - start_b.

A ring. Where every layer slides (a window and no global layers), a new token needs at most the window's
keys: the cache then holds the prompts' P slots and a ring of `ring` >= window slots after them, decode
step at slot t (`index` counts on) writing ring slot (t - P) mod ring, so the cache's size is bounded by
the prompts and the window whatever the number of new tokens. The prompts' slots stay as written (the
window masks out those that fall behind it).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maxtrain.ops.attention import PLAIN, Variant, against_cache
from maxtrain.parallel.rules import active_axes, active_mesh

AXES = ("batch", "cache_length", "kv_heads", "head_dim")  # the logical axes of a layer's keys or values


def layout(args) -> tuple[int, int, int]:
    """(rows per sequence, key width, value width) of a layer's cache: GQA's kv heads, each of head_dim;
    MLA's one row of its rotary key and its latent."""
    return args.attention.cache_layout()


def bytes_per_slot(args) -> int:
    """One layer's cache for one position of one sequence: keys and values."""
    rows, keys, values = layout(args)
    return rows * (keys + values) * jnp.dtype(args.dtype).itemsize


def _constrain(x_RxSxK, batch: int, kv_heads: int):
    """The rows split as (batch, kv_heads) would, the slots and head dim as the rules say."""
    if active_mesh() is None:
        return x_RxSxK
    b, s, n, k = active_axes(AXES, (batch, x_RxSxK.shape[1], kv_heads, x_RxSxK.shape[2]))
    spec = PartitionSpec(b + n or None, s or None, k or None)
    return jax.lax.with_sharding_constraint(x_RxSxK, spec)


def _physical(slot, slots: int, ring: int):
    """The slot of the cache that holds (logical) slot `slot`: in the ring past the prompts' slots."""
    if not ring:
        return slot
    first = slots - ring
    return jnp.where(slot >= first, first + (slot - first) % ring, slot)


def _write(cache_RxSxK, new_BxLxNxK, index):
    """The new keys (or values) in their rows at slots index .. index + L - 1."""
    b, length, n, k = new_BxLxNxK.shape
    rows_RxLxK = new_BxLxNxK.transpose(0, 2, 1, 3).reshape(b * n, length, k).astype(cache_RxSxK.dtype)
    return _constrain(jax.lax.dynamic_update_slice_in_dim(cache_RxSxK, rows_RxLxK, index, axis=1), b, n)


@flax.struct.dataclass
class LayerCache:
    """One layer's view of the cache, handed to its attention (maxtrain.models.attention)."""
    keys_RxSxK: jax.Array
    values_RxSxK: jax.Array
    start_B: jax.Array  # each sequence's first slot
    index: jax.Array    # the slot of this call's first position
    prefill: bool = flax.struct.field(pytree_node=False)  # this call writes the prompts from slot 0
    ring: int = flax.struct.field(pytree_node=False, default=0)  # the last `ring` slots are a ring; 0 = none

    def attend(self, q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL, kernel,
               variant: Variant = PLAIN, sinks_H=None):
        """(attention output [B,L,H,K], this layer's cache with k and v written). A prefill attends
        within the prompts by the training `kernel` (the cache holds nothing else yet); a decode step
        against the cache, each query seeing its sequence's slots up to its own (and within the window)."""
        written = self.write(k_BxLxNxK, v_BxLxNxK)
        if self.prefill:
            ctx_BxLxHxK = kernel(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL, variant, sinks_H)
        else:
            ctx_BxLxHxK = against_cache(q_BxLxHxK, written.keys_RxSxK, written.values_RxSxK,
                                        self.mask(q_BxLxHxK.shape[1], variant.window, variant.chunked), variant,
                                        sinks_H)
        return ctx_BxLxHxK, written

    def write(self, k_BxLxNxK, v_BxLxNxK) -> "LayerCache":
        """This layer's cache with the call's keys and values written at its slots."""
        at = _physical(self.index, self.keys_RxSxK.shape[1], self.ring)  # a decode step's one slot; a prefill's from 0
        return self.replace(keys_RxSxK=_write(self.keys_RxSxK, k_BxLxNxK, at),
                            values_RxSxK=_write(self.values_RxSxK, v_BxLxNxK, at))

    def mask(self, length: int, window: int = 0, chunked: bool = False):
        """[B, L, S]: the slots each of the call's `length` queries sees (after `write`): its sequence's, up
        to its own, within the window (`chunked`: within its chunk, counted from the sequence's first slot),
        written."""
        slots = self.keys_RxSxK.shape[1]
        query_slots_Lx1 = (self.index + jnp.arange(length))[:, None]
        slots_LxS = jnp.broadcast_to(jnp.arange(slots), (length, slots))
        written_LxS = True
        if self.ring:  # the logical slot each ring slot holds now: the latest at or before the query's
            in_ring_LxS = slots_LxS >= slots - self.ring
            slots_LxS = jnp.where(in_ring_LxS, query_slots_Lx1 - (query_slots_Lx1 - slots_LxS) % self.ring,
                                  slots_LxS)
            written_LxS = ~in_ring_LxS | (slots_LxS >= slots - self.ring)
        mask_BxLxS = ((slots_LxS[None] >= self.start_B[:, None, None]) & (slots_LxS <= query_slots_Lx1)[None]
                      & written_LxS)
        if window:
            mask_BxLxS = mask_BxLxS & (slots_LxS > query_slots_Lx1 - window)[None]
        if chunked:
            start_Bx1x1 = self.start_B[:, None, None]
            mask_BxLxS = mask_BxLxS & ((slots_LxS[None] - start_Bx1x1) // window
                                       == (query_slots_Lx1[None] - start_Bx1x1) // window)
        return mask_BxLxS


@flax.struct.dataclass
class KVCache:
    keys: tuple   # per layer, [R, S, K]
    values: tuple
    start_B: jax.Array  # int32 [B]: each sequence's first slot
    index: jax.Array    # int32 scalar: the next slot to write
    prefill: bool = flax.struct.field(pytree_node=False)
    ring: int = flax.struct.field(pytree_node=False, default=0)  # the last `ring` slots are a ring; 0 = none

    @classmethod
    def empty(cls, args, start_B, slots: int, ring: int = 0) -> "KVCache":
        """A cache of `slots` slots for len(start_B) sequences, ready for their prefill, its last `ring`
        a ring (every layer sliding, ring >= the window). Call under the mesh."""
        w = args.attention.window
        assert not ring or (w and w.every_layer and ring >= w.size), ring
        b, (n, k, v) = start_B.shape[0], layout(args)
        zeros = lambda width: _constrain(jnp.zeros((b * n, slots, width), args.dtype), b, n)  # noqa: E731
        return cls(tuple(zeros(k) for _ in range(args.layers)), tuple(zeros(v) for _ in range(args.layers)),
                   start_B.astype(jnp.int32), jnp.zeros((), jnp.int32), prefill=True, ring=ring)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[1]

    def positions(self, length: int):
        """[B, L]: the positions in each sequence of the next `length` slots."""
        return self.index + jnp.arange(length)[None, :] - self.start_B[:, None]

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self.keys[i], self.values[i], self.start_B, self.index, self.prefill, self.ring)

    def written(self, layers: list[LayerCache], length: int) -> "KVCache":
        """The cache after a call that wrote `length` positions through `layers`."""
        return KVCache(tuple(x.keys_RxSxK for x in layers), tuple(x.values_RxSxK for x in layers), self.start_B,
                       self.index + length, prefill=False, ring=self.ring)
