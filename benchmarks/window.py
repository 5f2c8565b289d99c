"""A sliding window's step against full causal attention: forward + backward of blockwise attention
(jit of value_and_grad of the output's sum, over q, k and v) at sequence 8W with window W, and the
full-causal blockwise at the same sequence, for a few W.

    python benchmarks/window.py [--windows 128 256 512 1024] [--batch 1] [--heads 8] [--kv-heads 8]
                                [--head-dim 64] [--dtypes float32 bfloat16] [--repeats 5]
                                [--window-blocks 64 128]

Each pair (windowed, full) is compiled and warmed up first, then timed interleaved, --repeats rounds
of one call each, on this process's first device: on a shared, noisy machine only runs taken one right
after the other compare fairly. It prints each row's medians and the ratio windowed / full.
--window-blocks: also time the windowed step with those queries per block (window_block's choice is
the row "auto"), to tune window_block.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from maxtrain.ops import attention, window_attention


def step(window: int, block: int | None, form: str = "stacked"):
    """jit(value_and_grad) of blockwise attention's sum; `block` overrides window_block's choice, with
    the windowed `form` (stacked keys, or banded) named."""
    variant = attention.Variant(window=window)
    windowed = attention.window_blocks if form == "stacked" else window_attention.banded_blocks

    def loss(q, k, v, segment_ids):
        if block is None:
            out = attention.blockwise(q, k, v, segment_ids, variant)
        else:
            out = windowed(q, k, v, segment_ids, block, variant)
        return jnp.sum(out.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def timed(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window-blocks", type=int, nargs="*", default=[])
    args = parser.parse_args()
    device = jax.devices()[0]
    print(f"blockwise attention, forward + backward, {device.platform} ({device.device_kind}); batch {args.batch}, "
          f"{args.heads} heads ({args.kv_heads} kv), head_dim {args.head_dim}; median of {args.repeats} "
          "interleaved rounds")
    print("| dtype | W | sequence | queries per block | windowed ms | full causal ms | windowed / full |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        for w in args.windows:
            length = 8 * w
            keys = jax.random.split(jax.random.key(w), 3)
            q = jax.random.normal(keys[0], (args.batch, length, args.heads, args.head_dim), dtype)
            k, v = (jax.random.normal(x, (args.batch, length, args.kv_heads, args.head_dim), dtype) for x in keys[1:])
            segment_ids = jnp.ones((args.batch, length), jnp.int32)
            inputs = jax.device_put((q, k, v, segment_ids), device)
            blocks = [None, *[(b, form) for b in args.window_blocks for form in ("stacked", "banded")]]
            fns = {("full", None): step(0, None), **{("window", b): step(w, *(b or (None,))) for b in blocks}}
            for fn in fns.values():  # compile and warm up
                for _ in range(2):
                    timed(fn, inputs)
            seconds = {name: [] for name in fns}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    seconds[name].append(timed(fn, inputs))
            full = statistics.median(seconds[("full", None)])
            for b in blocks:
                windowed = statistics.median(seconds[("window", b)])
                form = "stacked" if jnp.dtype(dtype) == jnp.float32 else "banded"
                label = f"auto ({attention.window_block(w, dtype)}, {form})" if b is None else f"{b[0]}, {b[1]}"
                print(f"| {dtype} | {w} | {length} | {label} | {windowed * 1e3:.1f} | {full * 1e3:.1f} | "
                      f"{windowed / full:.3f} |", flush=True)


if __name__ == "__main__":
    main()
