"""How fast this machine runs the compare.py rows' matmuls: XLA:CPU (what any JAX program gets) against
numpy's BLAS (OpenBLAS in the numpy wheel), the same shapes in float32, interleaved.

    python benchmarks/matmul_ceiling.py [--rounds 5]

The CPU rows of issue #7 spend most of a step in matmuls (`benchmarks/profile_step.py`), so their
speed is capped by the rate XLA's own matmul kernels reach on each shape; a CPU without bfloat16
arithmetic runs a bfloat16 matmul as a float32 one between converts. This prints that rate beside the
rate a hand-tuned BLAS reaches on the same shape and the same cores, to tell how much of a step's time
is in the program and how much in the compiler's kernels. Each round times every shape both ways (best of
three calls); the table shows medians over rounds.
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

# name, (rows, contracted, columns), whether the left operand is stored transposed (a weight gradient:
# x^T @ dY over the rows)
SHAPES = [
    ("probe: square 2048 (compare.py's peak)", (2048, 2048, 2048), False),
    ("small: output layer, forward", (1024, 256, 32000), False),
    ("small: output layer, input gradient", (1024, 32000, 256), False),
    ("small: output layer, weight gradient", (256, 1024, 32000), True),
    ("small: MLP up/gate, forward", (1024, 256, 1024), False),
    ("medium: output layer, forward", (2048, 512, 32000), False),
    ("medium: output layer, weight gradient", (512, 2048, 32000), True),
    ("medium: MLP up/gate, forward", (2048, 512, 2048), False),
]


def best_of(fn, calls: int = 3) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def product(a, b, transposed: bool):
    """a @ b, or a^T @ b for a weight gradient; numpy and jax arrays alike."""
    return (a.T if transposed else a) @ b


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    runs = []
    for name, (m, k, n), transposed in SHAPES:
        a = rng.standard_normal((k, m) if transposed else (m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        xla = jax.jit(functools.partial(product, transposed=transposed))
        a_dev, b_dev = jnp.asarray(a), jnp.asarray(b)
        xla(a_dev, b_dev).block_until_ready()  # compile
        runs.append((name, 2.0 * m * k * n,
                     lambda f=xla, a=a_dev, b=b_dev: f(a, b).block_until_ready(),
                     functools.partial(product, a, b, transposed)))
    rates = {name: ([], []) for name, *_ in runs}
    for _ in range(args.rounds):
        for name, flops, xla_call, blas_call in runs:
            rates[name][0].append(flops / best_of(xla_call) / 1e9)
            rates[name][1].append(flops / best_of(blas_call) / 1e9)
    blas = np.__config__.CONFIG["Build Dependencies"]["blas"]
    print(f"{len(jax.devices())} XLA device(s), numpy BLAS: {blas['name']} {blas.get('version', '')}, "
          f"{args.rounds} interleaved rounds, float32, GFLOP/s (medians)")
    print("| matmul | rows x contracted x columns | XLA:CPU | numpy BLAS | BLAS / XLA |\n|---|---|---|---|---|")
    for name, (m, k, n), _ in SHAPES:
        xla, blas_rate = (statistics.median(r) for r in rates[name])
        print(f"| {name} | {m} x {k} x {n} | {xla:.0f} | {blas_rate:.0f} | {blas_rate / xla:.2f}x |")


if __name__ == "__main__":
    main()
