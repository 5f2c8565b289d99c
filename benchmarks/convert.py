"""Time and peak memory of HF <-> maxtrain conversion, against the model's size.

    python benchmarks/convert.py [--hidden 1536 --layers 12 --vocab 32000]

Writes a random-weight LlamaForCausalLM with transformers, then runs each conversion in its own process
and reports its wall time and how far it raised the process's peak resident memory above what it had
after imports (VmHWM, Linux): a converter that held two copies of the model would show a ratio near 2.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# VmHWM (peak resident set), not ru_maxrss: a child inherits its parent's ru_maxrss across fork and exec.
MEASURE = """
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from maxtrain import convert
import orbax.checkpoint, safetensors  # imported before the baseline reading
peak_kib = lambda: int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
before = peak_kib()
t0 = time.perf_counter()
assert convert.main(sys.argv[1:]) == 0
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "peak_growth_bytes": (peak_kib() - before) * 1024}))
"""


def measure(function: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, function, *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{function} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    work = Path(tempfile.mkdtemp(prefix="maxtrain_convert_bench_"))
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(work / "hf")
    del model

    hf, ours = str(work / "hf"), str(work / "maxtrain")
    rows = [("hf_to_maxtrain (scanned)", measure("hf_to_maxtrain", "--hf_dir", hf, "--out", ours)),
            ("hf_to_maxtrain (unscanned)", measure("hf_to_maxtrain", "--hf_dir", hf, "--out", ours + "_unscanned",
                                                   "scan_layers=false")),
            ("maxtrain_to_hf, 2 GiB shards", measure("maxtrain_to_hf", "--checkpoint", ours, "--out", hf + "_1")),
            ("maxtrain_to_hf, 64 MiB shards", measure("maxtrain_to_hf", "--checkpoint", ours, "--out", hf + "_2",
                                                      "--max_shard_mb", "64"))]
    print(f"model: {model_bytes / 2**20:.0f} MiB float32 ({model_bytes // 4:,} parameters)")
    print(f"| {'conversion':<29} | {'seconds':>7} | {'peak memory growth':>18} | {'x model size':>12} |")
    print(f"|{'-' * 31}|{'-' * 9}|{'-' * 20}|{'-' * 14}|")
    for name, r in rows:
        growth = r["peak_growth_bytes"]
        print(f"| {name:<29} | {r['seconds']:7.1f} | {growth / 2**20:14.0f} MiB | {growth / model_bytes:12.2f} |")


if __name__ == "__main__":
    main()
