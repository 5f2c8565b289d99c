"""The tiny model's training step: maxtrain's command line against an eager PyTorch loop users would pick.

    python benchmarks/tiny_torch.py [--reference nanogpt|llama] [--rounds 3] [--steps 300]
                                    [--variants "" "remat_policy=none" "dtype=float32"]

(the hf extra: torch) 4 layers, width 128, 4 heads of 32, Tiny Shakespeare bytes (vocab 384), 12 sequences of
64 tokens a step, AdamW at 1e-3 (b2 0.95, weight decay 0.1 off the norms and biases, global-norm clipping at
1.0), float32 in torch, `loss.item()` every step as maxtrain reads its loss; timed with perf_counter.

- `--reference nanogpt` (the default): nanoGPT's GPT (karpathy/nanoGPT model.py, written here): learned
  positions, LayerNorm without bias, one fused q/k/v projection, causal F.scaled_dot_product_attention, a
  4x GELU MLP, the output tied to the embedding. maxtrain runs its Llama at the same matmul FLOPs: SwiGLU
  of width 344 (3 x 128 x 344 against nanoGPT's 2 x 128 x 512 multiply-adds per token).
- `--reference llama`: maxtrain's own decoder in PyTorch (RMSNorm, RoPE, SwiGLU 512, untied output, the
  same fused q/k/v and attention); maxtrain with SwiGLU 512.
- maxtrain: `python -m maxtrain.train configs/shakespeare.yml <the shape> steps=S learning_rate=1e-3
  eval_interval=0 log_period=1 enable_checkpointing=false` plus the variant's keys, as a user types it (a
  fresh process, the platform defaults, Tiny Shakespeare through the grain pipeline, every step's metrics
  read and written); its s/step per step from its metrics.jsonl.

Each round runs every maxtrain variant and torch back to back (the machine is shared: only runs taken
together compare); a run's figure is the median step time of its steps after the first 50 (compile and
warm-up), the table's the median over rounds, with the range; "steps/s vs torch" is torch's s/step over
the variant's, paired within each round (the median of those).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
SHAPE = ["base_num_decoder_layers=4", "base_emb_dim=128", "base_num_query_heads=4", "base_num_kv_heads=4",
         "head_dim=32", "max_target_length=64", "per_device_batch_size=12"]
LAYERS, WIDTH, HEADS, MLP, LENGTH, BATCH, VOCAB = 4, 128, 4, 512, 64, 12, 384
SWIGLU_AT_NANOGPT_FLOPS = 344  # 3 x 344 ~ 2 x 4 x 128: a SwiGLU's matmuls as nanoGPT's 4x MLP's
WARMUP = 50  # steps left out of a run's median


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.RMSNorm(WIDTH, eps=1e-5), nn.RMSNorm(WIDTH, eps=1e-5)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.gate_up, self.down = nn.Linear(WIDTH, 2 * MLP, bias=False), nn.Linear(MLP, WIDTH, bias=False)

    def forward(self, x, cos, sin):
        b, length, _ = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(b, length, 3, HEADS, WIDTH // HEADS).transpose(1, 3).unbind(2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, length, WIDTH)
        x = x + self.out(ctx)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rotate(x, cos, sin):  # RoPE on the two halves of each head, as maxtrain's
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.output = nn.RMSNorm(WIDTH, eps=1e-5), nn.Linear(WIDTH, VOCAB, bias=False)
        half = WIDTH // HEADS // 2
        angles = torch.arange(LENGTH)[:, None] * 10000.0 ** (-torch.arange(half) / half)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.output(self.norm(x))


class GPTBlock(nn.Module):
    """nanoGPT's Block (bias=False, dropout 0): pre-LayerNorm attention and a 4x GELU MLP."""

    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH, bias=False), nn.LayerNorm(WIDTH, bias=False)
        self.c_attn, self.c_proj = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(WIDTH, 4 * WIDTH, bias=False), nn.Linear(4 * WIDTH, WIDTH, bias=False)
        self.gelu = nn.GELU()

    def forward(self, x):
        b, length, _ = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(WIDTH, dim=2)
        q, k, v = (t.view(b, length, HEADS, WIDTH // HEADS).transpose(1, 2) for t in (q, k, v))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous()
        x = x + self.c_proj(ctx.view(b, length, WIDTH))
        return x + self.mlp_proj(self.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT's GPT: token and learned position embeddings, the blocks, a final LayerNorm, the output tied to
    the token embedding; its init (normal 0.02, residual projections scaled by 1/sqrt(2 x layers))."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.h = nn.ModuleList(GPTBlock() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH, bias=False)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / (2 * LAYERS) ** 0.5 if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                torch.nn.init.normal_(p, 0.0, std)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def torch_run(steps: int, reference: str) -> list[float]:
    """Each step's seconds of the eager loop."""
    torch.manual_seed(0)
    data = np.frombuffer((REPO / "data" / "tinyshakespeare.txt").read_bytes(), np.uint8).astype(np.int64) + 3
    rng = np.random.default_rng(0)
    model = GPT() if reference == "nanogpt" else Decoder()
    # nanoGPT's configure_optimizers: weight decay on the matrices only
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    kept = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": kept, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        starts = rng.integers(0, len(data) - LENGTH - 1, BATCH)
        window = torch.from_numpy(np.stack([data[s:s + LENGTH + 1] for s in starts]))
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    return times


def maxtrain_run(steps: int, variant: list[str], reference: str) -> tuple[list[float], str]:
    """Each logged step's seconds of the command line, and the run's first line (the platform defaults)."""
    mlp = SWIGLU_AT_NANOGPT_FLOPS if reference == "nanogpt" else MLP
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "maxtrain.train", "configs/shakespeare.yml", *SHAPE, f"base_mlp_dim={mlp}",
                   f"steps={steps}",
                   "learning_rate=1e-3", "eval_interval=0", "log_period=1", "enable_checkpointing=false",
                   f"base_output_directory={out}", "run_name=tiny", *variant]
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"maxtrain failed: {' '.join(command)}\n{proc.stderr[-2000:]}")
        first = next(line for line in proc.stdout.splitlines() if line.startswith("maxtrain:"))
        lines = [json.loads(x) for x in (Path(out) / "tiny" / "metrics.jsonl").read_text().splitlines()]
        times = [x["train/step_seconds"] for x in lines if "train/step_seconds" in x]
    return times, first


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", choices=("nanogpt", "llama"), default="nanogpt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--variants", nargs="*", default=["", "remat_policy=none", "dtype=float32"],
                        help='maxtrain variants, each a space-separated list of key=value ("": the command as is)')
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    torch.set_num_threads(os.cpu_count())
    print(f"{time.strftime('%Y-%m-%d')} | {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.2f} | torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads) | {args.rounds} rounds of {args.steps} steps, "
          f"medians of the steps after {WARMUP}")
    torch_name = {"nanogpt": "nanoGPT's GPT, eager PyTorch, float32", "llama": "eager PyTorch Llama, float32"}
    names = [v or "(the command)" for v in args.variants] + [torch_name[args.reference]]
    seconds = {name: [] for name in names}
    firsts = {}
    for r in range(args.rounds):
        for variant, name in zip(args.variants, names):
            times, firsts[name] = maxtrain_run(args.steps, variant.split(), args.reference)
            seconds[name].append(statistics.median(times[WARMUP:]))
        seconds[names[-1]].append(statistics.median(torch_run(args.steps, args.reference)[WARMUP:]))
        print(f"round {r + 1}: " + ", ".join(f"{n} {s[-1] * 1e3:.1f} ms" for n, s in seconds.items()), flush=True)
    for name, line in firsts.items():
        print(f"{name}: {line}")
    print("\n| run | ms/step | range | steps/s vs torch |\n|---|---|---|---|")
    for name, runs in seconds.items():
        ratio = statistics.median(t / s for t, s in zip(seconds[names[-1]], runs))
        print(f"| {name} | {statistics.median(runs) * 1e3:.1f} | {min(runs) * 1e3:.1f}-{max(runs) * 1e3:.1f} | "
              f"{ratio:.2f}x |")


if __name__ == "__main__":
    main()
