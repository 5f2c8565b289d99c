"""The operand types of every matmul in the compiled train step, as the compiler left them.

    python benchmarks/quantized_dots.py configs/base.yml model_name=llama2-7b compile_topology=v5p-128 \
        per_device_batch_size=4 max_target_length=4096 quantization=int8

Runs `maxtrain.compile` with the arguments given, dumping the optimized HLO of the step, and prints one
row per (einsum, left operand type, right operand type, result type) with how many times it occurs:
whether the quantized matmuls reach the target's compiler as 8-bit convolutions or are widened before.
"""

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def convolutions(hlo: str):
    """Counter of (einsum name, lhs dtype, rhs dtype, result dtype) over the HLO's convolutions and dots."""
    counts, types = collections.Counter(), {}
    for line in hlo.splitlines():
        if not line.startswith(" "):  # a new computation: its own value names
            types = {}
        defined = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[", line)
        if defined:
            types[defined.group(1)] = defined.group(2)
        op = re.search(r" (?:convolution|dot)\((%[\w.\-]+), (%[\w.\-]+)\)", line)
        if defined and op:
            name = re.search(r'op_name="([^"]*)/dot_general"', line)
            einsum = name.group(1).split("/")[-1] if name else "?"
            counts[(einsum, types.get(op.group(1)), types.get(op.group(2)), defined.group(2))] += 1
    return counts


def main():
    with tempfile.TemporaryDirectory() as dump:
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                                          "--xla_dump_hlo_module_re=jit_step"}
        proc = subprocess.run([sys.executable, "-m", "maxtrain.compile", *sys.argv[1:]], env=env,
                              capture_output=True, text=True)
        print("\n".join(line for line in proc.stdout.splitlines() if "memory per device" in line))
        files = sorted(Path(dump).glob("*jit_step*after_optimizations.txt"))
        if not files:
            sys.exit(f"no optimized HLO was dumped: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        print("| einsum | lhs | rhs | result | count |\n|---|---|---|---|---|")
        for (einsum, lhs, rhs, result), n in sorted(convolutions(files[0].read_text()).items()):
            print(f"| {einsum} | {lhs} | {rhs} | {result} | {n} |")


if __name__ == "__main__":
    main()
