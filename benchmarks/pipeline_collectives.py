"""What crosses the slices: the bytes each chip moves per train step, by collective, over DCN (between
slices) and over ICI (within a slice), read from the compiled HLO of llama3.1-70b on 2 x v5p-128.

    PYTHONPATH=. python benchmarks/pipeline_collectives.py [key=value ...]

Rows: the pipeline across the slices (dcn_pipeline_parallelism=2, GPipe and circular x4) against fsdp
across the slices (dcn_fsdp_parallelism=2). Each is compiled as `python -m maxtrain.compile` compiles it
(its topology and the same train step; needs the tpu extra), with the extra key=value on every row.

How the bytes are read. libtpu compiles one program for all the slices: a collective within a slice is
an ordinary HLO collective (replica groups among the 64 chips of a slice); one that crosses the slices
becomes send/recv pairs for the Megascale (DCN) runtime, each tagged with its kind of transfer and its
peers. Bytes per chip, for a group of N peers (ring algorithms): all-gather and all-to-all (N-1)/N of
the whole result, reduce-scatter (N-1) times its piece, all-reduce 2 (N-1)/N of its buffer; a
collective permute its buffer times the share of chips that send. A loop's body counts once per
iteration (the trip count from its condition's `i < constant`; jax's loops count from 0), a conditional
its largest branch. Within a slice XLA builds the fsdp weight all-gathers (and the gradient
reductions) as all-reduces of zero-padded buffers, with or without the pipeline: they show in the ICI
all-reduce column.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

from maxtrain import compile as compile_lib
from maxtrain.config import load as config_lib, resolve
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib

BASE = ["configs/base.yml", "model_name=llama3.1-70b", "compile_topology=v5p-128", "compile_topology_num_slices=2",
        "ici_fsdp_parallelism=64", "per_device_batch_size=2", "max_target_length=4096"]
ROWS = [("fsdp across slices (dcn_fsdp 2)", ["dcn_fsdp_parallelism=2"]),
        ("pipeline GPipe (dcn_pipeline 2, 4 micro)", ["dcn_pipeline_parallelism=2", "num_pipeline_microbatches=4"]),
        ("pipeline circular x4 (10 layers/stage)", ["dcn_pipeline_parallelism=2", "num_pipeline_microbatches=4",
                                                    "num_layers_per_pipeline_stage=10"])]
KINDS = ("collective-permute", "all-gather", "reduce-scatter", "all-reduce", "all-to-all")
MEGASCALE = {"ONE_TO_ONE": "collective-permute", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
             "ALL_REDUCE": "all-reduce", "ALL_TO_ALL": "all-to-all"}
BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
SHAPE = re.compile(r"\b(" + "|".join(BYTES) + r")\[([0-9,]*)\]")
INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\(")
COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
CALLS = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|true_computation|false_computation)="
                   r"(\{[^}]*\}|%?[\w.\-]+)")


def compiled_step(argv: list[str]):
    """(resolved config, compiled train step, devices, slices): maxtrain.compile's topology, mesh and
    step, without its memory checks."""
    c_static = config_lib.load(argv)
    _, spec, _, _ = compile_lib.topology(c_static.compile_topology)
    devices = compile_lib.topology_desc(c_static.compile_topology, spec, c_static.compile_topology_num_slices).devices
    c = resolve.resolve(c_static, len(devices), resolve.num_slices(devices), "tpu")
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        compiled = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile()
    return c, compiled, len(devices), resolve.num_slices(devices)


def nbytes(text: str, first: bool = False) -> float:
    """Bytes of every array shape written in `text` (a tuple's elements summed), or of the first."""
    shapes = SHAPE.findall(text)[:1] if first else SHAPE.findall(text)
    return sum(BYTES[t] * elements(d) for t, d in shapes)


def result_bytes(op: str, result: str) -> float:
    """The bytes of a collective's result (the compiled HLO names operands without their shapes); an
    async start returns (operands, results, ...): a collective permute's operand, a gather's results."""
    if op == "collective-permute-start":
        return nbytes(result, first=True)
    if op.endswith("-start") and result.startswith("(("):
        return nbytes(result[result.index(")") + 1:])
    return nbytes(result)


def elements(dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def group_size(line: str) -> int:
    """Peers in each replica group: {{0,1,..},..} or the iota form [groups,size]<=[...]."""
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line):
        return int(m.group(2))
    if m := re.search(r"replica_groups=\{\{([0-9,]*)\}", line):
        return len(m.group(1).split(","))
    return 1


def parse(hlo: str):
    """{computation: [(instruction line, [(callee, times)])]}, and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        if (m := COMP.match(line)) and "=" not in line.split("(")[0]:
            current = m.group(1)
            comps[current] = []
            entry = current if line.startswith("ENTRY") else entry
            continue
        if current is None or not INSTR.match(line):
            continue
        callees = []
        for key, target in CALLS.findall(line):
            names = re.findall(r"%?([\w.\-]+)", target.strip("{}"))
            callees += [(n, "loop" if key in ("body", "condition") else 1) for n in names]
        comps[current].append((line, callees))
    for instrs in comps.values():  # a loop's callees run its trip count times
        for i, (line, callees) in enumerate(instrs):
            if any(k == "loop" for _, k in callees):
                trip = trip_count(line, comps)
                instrs[i] = (line, [(n, trip if k == "loop" else k) for n, k in callees])
    return comps, entry


def trip_count(line: str, comps) -> int:
    """A while loop's iterations: XLA's known_trip_count where it wrote one, else its condition's
    `counter < constant` (jax's loops count from 0 by 1)."""
    if m := re.search(r'"known_trip_count":\{"n":"(\d+)"', line):
        return int(m.group(1))
    cond = comps.get(re.search(r"condition=%?([\w.\-]+)", line).group(1), [])
    constants = {re.match(r"\s*%?([\w.\-]+) =", l).group(1): int(c.group(1)) for l, _ in cond
                 if (c := re.search(r"\bs32\[\][^ ]* constant\((\d+)\)", l))}
    for l, _ in cond:
        if l.lstrip().startswith("ROOT") and " compare(" in l and "direction=LT" in l:
            for name in re.findall(r"%([\w.\-]+)", l.split(" compare(")[1].split(")")[0]):
                if name in constants:
                    return constants[name]
    print(f"note: a while loop of unknown trip count counted once: {line[:80]}", file=sys.stderr)
    return 1


def per_chip_bytes(hlo: str, devices: int, slices: int) -> dict[tuple[str, str], float]:
    """{("DCN" | "ICI", kind): bytes per chip per step} of the compiled HLO text of a program on `devices`
    chips in `slices` slices: a loop's body counts its trip count times, a conditional its largest
    branch (a chip runs one)."""
    comps, entry = parse(hlo)
    memo: dict[str, dict] = {}

    def total(name: str) -> dict:
        if name in memo:
            return memo[name]
        out: dict[tuple[str, str], float] = defaultdict(float)
        for line, callees in comps.get(name, ()):
            if " conditional(" in line:
                branches = [total(n) for n, _ in callees]
                for key, b in max(branches, key=lambda d: sum(d.values()), default={}).items():
                    out[key] += b
            else:
                for callee, times in callees:
                    for key, b in total(callee).items():
                        out[key] += b * times
            _, result, op = INSTR.match(line).groups()
            if op == "send" and "xla_megascale" in line:  # (buffer, u32[], token[])
                kind, moved = megascale_bytes(line, nbytes(result, first=True), devices)
                out[("DCN", kind)] += moved
            elif op.removesuffix("-start") in KINDS:
                kind = op.removesuffix("-start")
                out[("ICI", kind)] += ici_bytes(kind, line, result_bytes(op, result), devices // slices)
        memo[name] = out
        return out
    return total(entry)


def megascale_bytes(line: str, buffer: float, devices: int) -> tuple[str, float]:
    """(kind, bytes per chip) of a send of `buffer` bytes to the DCN runtime."""
    kind = MEGASCALE[re.search(r'_xla_megascale_transfer_type="(\w+)"', line).group(1)] \
        if "_xla_megascale_transfer_type" in line else "collective-permute"
    target = re.search(r"_xla_megascale_target=(\"[^\"]*\"|\{\{.*?\}\})", line).group(1)
    if kind == "collective-permute":  # {{src->dst},...}: only the sources send
        return kind, buffer * target.count("->") / devices
    if target.startswith('"'):  # "{slices}x{chips}": a group is one chip of each slice
        peers = len(target.strip('"').split("x")[0].strip("{}").split(","))
    else:
        peers = len(target[2:].split("}")[0].split(","))
    share = (peers - 1) / peers
    if kind == "all-gather":  # the buffer sent is this chip's piece of the gathered result
        return kind, buffer * (peers - 1)
    return kind, buffer * share * (2 if kind == "all-reduce" else 1)


def ici_bytes(kind: str, line: str, result: float, chips: int) -> float:
    """Bytes per chip of a collective within a slice of `chips` (its ids: the chips of one slice), from
    the bytes of its result."""
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
        sources = pairs.group(1).count("{") if pairs else 0
        return result * sources / chips
    n = group_size(line)
    share = (n - 1) / n
    if kind == "reduce-scatter":  # the result is this chip's piece of the n
        return result * (n - 1)
    return result * share * (2 if kind == "all-reduce" else 1)  # all-gather, all-to-all: the whole


def gib(x: float) -> str:
    return f"{x / 2 ** 30:.2f}"


def main():
    if sys.argv[1:2] == ["--hlo"]:  # a saved compiled HLO text: --hlo FILE DEVICES SLICES
        moved = per_chip_bytes(open(sys.argv[2]).read(), int(sys.argv[3]), int(sys.argv[4]))
        for (link, kind), b in sorted(moved.items()):
            print(f"{link} {kind}: {gib(b)} GiB")
        return
    extra = sys.argv[1:]
    header = [f"DCN {k}" for k in KINDS] + ["DCN total"] + [f"ICI {k}" for k in KINDS] + ["ICI total"]
    print("llama3.1-70b, v5p-128 x 2 slices, batch 256 x 4096, remat full | GiB per chip per step | overrides: "
          f"{' '.join(extra) or '(none)'}")
    print("| config | " + " | ".join(header) + " |")
    print("|---|" + "---|" * len(header))
    for label, keys in ROWS:
        _, compiled, devices, slices = compiled_step(BASE + keys + extra)
        moved = per_chip_bytes(compiled.as_text(), devices, slices)
        cells = []
        for link in ("DCN", "ICI"):
            cells += [gib(moved[(link, k)]) for k in KINDS] + [gib(sum(moved[(link, k)] for k in KINDS))]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
