"""Memory per chip against sequence length, the tokens per chip fixed: llama3-8b on v5p-128 (64 chips),
8,192 tokens a chip, the context axis growing with the sequence (fsdp takes the rest of the chips).

    python benchmarks/long_context.py [--maxtext PYTHON] [key=value ...]

Each row is `python -m maxtrain.compile` (needs the tpu extra) with the plain command's defaults
(bfloat16 compute, float32 weights and Adam, remat full, splash attention); with --maxtext, MaxText's
own train_compile of the same row, on the same libtpu (see compare.py).
"""

import argparse

import compare

TOKENS_PER_CHIP, CHIPS = 8192, 64
ROWS = [(8192, 1), (32768, 4), (131072, 16)]  # sequence length, context axis


def row_overrides(length: int, context: int) -> list[str]:
    return ["model_name=llama3-8b", f"max_target_length={length}", f"ici_context_parallelism={context}",
            f"ici_fsdp_parallelism={CHIPS // context}", f"per_device_batch_size={TOKENS_PER_CHIP / length:g}"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maxtext", metavar="PYTHON", help="also compile each row with MaxText")
    args, extra = parser.parse_known_args()
    here = " MaxText GiB | ratio |" if args.maxtext else ""
    print(f"llama3-8b, v5p-128, {TOKENS_PER_CHIP} tokens per chip | overrides: {' '.join(extra) or '(none)'}")
    print(f"| sequence | context x fsdp | sequences | maxtrain GiB per chip | detail |{here}")
    print("|---|---|---|---|---|" + "---|---|" * bool(args.maxtext))
    for length, context in ROWS:
        overrides = row_overrides(length, context)
        gib, detail = compare.aot_gib(overrides, extra)
        row = f"| {length:,} | {context} x {CHIPS // context} | {CHIPS * TOKENS_PER_CHIP // length} | {gib:.2f} | {detail} |"
        if args.maxtext:
            mt_gib, _ = compare.maxtext_aot_gib(args.maxtext, overrides)
            row += f" {mt_gib:.2f} | {compare.less(gib, mt_gib)} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
