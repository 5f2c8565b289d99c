"""Input pipeline speed (text -> tokenize -> pack -> batch) per tokenizer, against what the training
step of the ~22M-parameter throughput config consumes, on this machine, in one run.

    python benchmarks/data.py [--seconds 5]

The pipeline must stay ahead of the step: the ratio column should be >= 5.
"""

import argparse
import tempfile
import time
from pathlib import Path

from throughput import CONFIG, measure  # same folder

from maxtrain.data import pipeline as data
from maxtrain import train
from maxtrain.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer

REPO = Path(__file__).parent.parent
TEXT = REPO / "data" / "tinyshakespeare.txt"


def hf_tokenizer(workdir: Path) -> HuggingFaceTokenizer:
    """A byte-level BPE (vocab 8192) trained on the corpus, saved and loaded as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(TEXT)], trainers.BpeTrainer(vocab_size=8192, special_tokens=["<pad>", "<s>", "</s>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(workdir / "tokenizer.json"))
    return HuggingFaceTokenizer(str(workdir / "tokenizer.json"), True, True, "<s>", "</s>")


def sentencepiece_tokenizer():
    try:
        import mistral_common
    except ImportError:
        return None
    return SentencePieceTokenizer(str(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"), True, True)


def pipeline_tokens_per_second(c, tokenizer, seconds: float) -> float:
    docs = data.document_source(c, [str(TEXT)])
    it = iter(data.make_dataset(c, docs, tokenizer, process_index=0, process_count=1, train=True))
    next(it)  # start-up (threads, first shuffle) is not throughput
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tokens += int(next(it)["weights"].sum())
    return tokens / (time.perf_counter() - t0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    c = train.load_config(CONFIG + ["dataset_type=text", f"train_files={TEXT}"])
    step = measure(c, steps=3)
    step_tps = c.global_batch_size * c.max_target_length / step["seconds"]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = [("byte", ByteTokenizer(True, True)), ("huggingface BPE 8k", hf_tokenizer(Path(tmp))),
                      ("sentencepiece llama 32k", sentencepiece_tokenizer())]
        rows = [(name, pipeline_tokens_per_second(c, tok, args.seconds)) for name, tok in tokenizers if tok]
    print(f"train step ({c.num_params / 1e6:.0f}M params, batch {c.global_batch_size} x {c.max_target_length}, "
          f"remat {c.remat_policy}) consumes {step_tps:,.0f} tokens/s")
    print("| tokenizer | pipeline tokens/s | pipeline / step |\n|---|---|---|")
    for name, tps in rows:
        print(f"| {name} | {tps:,.0f} | {tps / step_tps:,.1f}x |")


if __name__ == "__main__":
    main()
