"""The tokenizer a training run used, written beside an HF export so that transformers' AutoTokenizer loads
it and encodes a prompt as the run did (maxtrain.generate: bos if add_bos, no eos), with the run's special
token ids and context length for config.json.

The run is found from the step directory (<run>/checkpoints/<step>: its <run>/config.yml). A huggingface
tokenizer goes out as its tokenizer.json with the run's bos in its post-processor (maxtrain adds bos itself
and encodes without the file's own special tokens); a sentencepiece one as its tokenizer.model; the byte
tokenizer as a tokenizer.json that spells it (pad 0, bos 1, eos 2, then the 256 bytes). Synthetic data has
no tokenizer: nothing is written and the ids stay null. max_position_embeddings is the run's
max_target_length: the context the weights were trained on (RoPE runs longer, untrained).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from maxtrain.config import load as config_lib
from maxtrain.runtime import storage
from maxtrain.runtime.errors import ConvertError
from maxtrain.data.tokenizer import ByteTokenizer

_KEYS = ("dataset_type", "tokenizer_type", "tokenizer_path", "hf_bos_token", "hf_eos_token", "add_bos",
         "max_target_length")


def run_settings(step_dir: Path) -> dict[str, Any] | None:
    """The tokenizer keys of the run that saved `step_dir`, from its config.yml (the last record, if the file
    holds several); None where the step is not inside a run directory."""
    path = step_dir.parent.parent / "config.yml"
    try:
        records = [r for r in yaml.safe_load_all(path.read_text()) if isinstance(r, dict)]
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    if not records:
        return None
    defaults = config_lib.defaults()
    settings = {k: records[-1].get(k, defaults[k]) for k in _KEYS}
    if records[-1].get("data_sources"):  # a mixture reads text whatever dataset_type (its sources') says
        settings["dataset_type"] = "text"
    if settings["dataset_type"] != "synthetic" and settings["tokenizer_type"] != "byte":
        settings["tokenizer_path"] = _from_where_the_run_started(settings["tokenizer_path"], path.parent)
        tokenizer = storage.path(settings["tokenizer_path"] or ".", "tokenizer_path")
        if not tokenizer.is_file():
            raise ConvertError(f"the run's tokenizer_path {settings['tokenizer_path'] or '(empty)'} (in {path}) is not "
                               "a file: export writes the run's tokenizer; give --hf_source DIR to take another's")
    return settings


def _from_where_the_run_started(value: str, run_dir) -> str:
    """A relative local path as the run read it: from the directory its first start ran in (starts.jsonl's
    cwd), so an export from elsewhere finds the same file."""
    if not value or storage.is_url(value) or Path(value).is_absolute():
        return value
    try:
        first = json.loads((run_dir / "starts.jsonl").read_text().splitlines()[0])
        return str(Path(first["cwd"]) / value)
    except (OSError, IndexError, KeyError, TypeError, ValueError):  # a run from before starts.jsonl kept cwd
        return value


def write(s: dict[str, Any], out: Path) -> dict[str, Any]:
    """Writes the run's tokenizer files into `out`; returns the config.json keys that go with them."""
    hf = {"max_position_embeddings": s["max_target_length"]}
    if s["dataset_type"] == "synthetic" and not s.get("data_sources"):  # its token ids stand for nothing a tokenizer could name
        return hf
    settings: dict[str, Any] = {}  # tokenizer_config.json's, beyond the special tokens
    if s["tokenizer_type"] == "sentencepiece":
        import sentencepiece
        # a new file, not a copy of the source's modes (see staging); the source may be a URL
        (out / "tokenizer.model").write_bytes(storage.path(s["tokenizer_path"]).read_bytes())
        sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
        piece = {i: sp.IdToPiece(i) if i >= 0 else None for i in (sp.bos_id(), sp.eos_id(), sp.unk_id())}
        tokens = {"bos_token": piece[sp.bos_id()], "eos_token": piece[sp.eos_id()], "unk_token": piece[sp.unk_id()]}
        ids = {"bos_token_id": sp.bos_id() if sp.bos_id() >= 0 else None,
               "eos_token_id": sp.eos_id() if sp.eos_id() >= 0 else None}
        # transformers' class for a plain sentencepiece file: the same ids for ordinary text; its conversion
        # treats runs of whitespace and a leading space differently from sentencepiece itself
        tokenizer_class = "LlamaTokenizer"
        settings["split_special_tokens"] = True  # sentencepiece reads "<s>" in a text as text, not as bos
    else:
        if s["tokenizer_type"] == "byte":
            tok = _byte_tokenizer()
            tokens = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
            settings["split_special_tokens"] = True  # the run read "<s>" in a text as three bytes, not as bos
        else:
            import tokenizers
            tok = tokenizers.Tokenizer.from_str(storage.path(s["tokenizer_path"]).read_text())
            tokens = {"bos_token": s["hf_bos_token"] or None, "eos_token": s["hf_eos_token"] or None}
        ids = {f"{k}_id": tok.token_to_id(v) if v else None for k, v in tokens.items()}
        tok.post_processor = _post_processor(tok.post_processor, tokens["bos_token"] if s["add_bos"] else None,
                                             ids["bos_token_id"])
        tok.save(str(out / "tokenizer.json"))
        tokenizer_class = "PreTrainedTokenizerFast"
    tokens = {k: v for k, v in tokens.items() if v is not None}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": tokenizer_class, **tokens, "add_bos_token": bool(s["add_bos"]) and "bos_token" in tokens,
         "add_eos_token": False, "model_max_length": s["max_target_length"], "clean_up_tokenization_spaces": False,
         **settings}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2) + "\n")
    return hf | ids


def _post_processor(current, bos: str | None, bos_id: int | None):
    """bos before every sequence, as the run added it; the file's own special-token templates go (the run
    encoded without them); a byte-level offsets fix stays."""
    from tokenizers import processors
    keep = current if isinstance(current, processors.ByteLevel) else None
    if bos is None or bos_id is None:
        return keep
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                             special_tokens=[(bos, bos_id)])
    return processors.Sequence([keep, template]) if keep is not None else template


def _byte_tokenizer():
    """maxtrain's byte tokenizer in HF's terms: GPT-2's byte-level alphabet as a vocabulary without merges,
    so each UTF-8 byte b is one token, id b + 3, after <pad>, <s>, </s>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    char = {b: chr(b if b in visible else next(extra)) for b in range(256)}  # GPT-2's bytes_to_unicode
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {char[b]: b + ByteTokenizer.OFFSET for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<s>", "</s>")])
    return tok
