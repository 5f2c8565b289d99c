"""Tokenizers behind one interface: byte (no file), sentencepiece (.model), huggingface (tokenizer.json)."""

from __future__ import annotations

import hashlib
import json

import numpy as np

from maxtrain.runtime import storage
from maxtrain.runtime.errors import ConfigError


class Tokenizer:
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    kind = "byte"
    file_sha256 = ""  # the tokenizer file's, for tokenizers read from one

    def __init__(self, add_bos: bool, add_eos: bool):
        self.add_bos, self.add_eos = add_bos, add_eos

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._encode(t) for t in texts]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Many documents at once: the HF and sentencepiece tokenizers encode them on all cores."""
        head = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        tail = [self.eos_id] if self.add_eos and self.eos_id is not None else []
        return [np.asarray([*head, *ids, *tail], np.int32) for ids in self._encode_batch(texts)]

    def identity(self) -> dict:
        """What makes two tokenizers give the same ids: prepared data records it, and a run on that data must
        match it (the file's checksum, not its path: a copy elsewhere is the same tokenizer)."""
        return {"type": self.kind, "sha256": self.file_sha256, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id if self.add_bos else None, "eos_id": self.eos_id if self.add_eos else None}

    def decode(self, ids) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        """Its vocabulary and the bos and eos it adds, for the first lines."""
        added = [f"{role} {i}" for role, i, on in (("bos", self.bos_id, self.add_bos), ("eos", self.eos_id, self.add_eos))
                 if on and i is not None]
        return f"vocab {self.vocab_size:,}; adds " + (", ".join(added) or "no bos or eos")

    def encode(self, text: str) -> np.ndarray:
        ids = self._encode(text)
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if self.add_eos and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return np.asarray(ids, np.int32)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes shifted past three specials: pad 0, bos 1, eos 2; vocab 259."""

    OFFSET = 3
    bos_id, eos_id, vocab_size = 1, 2, 256 + OFFSET

    def _encode(self, text):
        return (np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self.OFFSET).tolist()

    def encode_batch(self, texts):
        head = [self.bos_id] if self.add_bos else []
        tail = [self.eos_id] if self.add_eos else []
        return [np.concatenate([head, np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) + self.OFFSET,
                                tail]).astype(np.int32) for t in texts]

    def decode(self, ids):
        # ids past the 256 bytes (a model's vocabulary larger than this tokenizer's) stand for no text
        data = bytes(int(i) - self.OFFSET for i in ids if self.OFFSET <= int(i) < self.vocab_size)
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str, add_bos: bool, add_eos: bool):
        super().__init__(add_bos, add_eos)
        import sentencepiece
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            model = storage.path(path).read_bytes()  # sentencepiece reads local files; the bytes work for URLs too
            self._sp.LoadFromSerializedProto(model)
        except (OSError, RuntimeError):
            raise ConfigError("tokenizer_path", f"{path}: cannot load as a sentencepiece model") from None
        self.file_sha256 = hashlib.sha256(model).hexdigest()
        self.vocab_size = self._sp.GetPieceSize()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def _encode(self, text):
        return self._sp.EncodeAsIds(text)

    def _encode_batch(self, texts):
        return self._sp.Encode(texts, out_type=int, num_threads=-1)

    def decode(self, ids):
        return self._sp.DecodeIds([int(i) for i in ids])


class HuggingFaceTokenizer(Tokenizer):
    kind = "huggingface"

    def __init__(self, path: str, add_bos: bool, add_eos: bool, bos_token: str, eos_token: str):
        super().__init__(add_bos, add_eos)
        import tokenizers
        try:
            text = storage.path(path).read_bytes()  # tokenizers reads local files; the text works for URLs too
            self._tok = tokenizers.Tokenizer.from_str(text.decode("utf-8"))
        except Exception:  # the Rust side raises a bare Exception for unparseable files
            raise ConfigError("tokenizer_path", f"{path}: cannot load as a HuggingFace tokenizer.json") from None
        self.file_sha256 = hashlib.sha256(text).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        found = _special_tokens(path, json.loads(text))
        self.sources = {}  # where bos and eos came from, for the first lines
        for key, role, given, wanted in (("hf_bos_token", "bos", bos_token, add_bos),
                                         ("hf_eos_token", "eos", eos_token, add_eos)):
            token, where = (given, key) if given else found.get(role, (None, None))
            if token is None and wanted:
                raise ConfigError(key, f"{path} names no {role} token (no tokenizer_config.json beside it says one, "
                                  f"nor its post-processor or special tokens): set {key}=TOKEN, or "
                                  f"add_{role}=false")
            setattr(self, f"{role}_id", self._token_id(key, token, path) if token else None)
            self.sources[role] = (token, where)

    def _token_id(self, key: str, token: str, path: str) -> int:
        """The id of a special token named by its text; a name the vocabulary lacks would silently
        drop every document's bos or eos."""
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ConfigError(key, f"{token!r} is not a token of {path}")
        return token_id

    def describe(self) -> str:
        parts = [f"{role} {token!r} = {getattr(self, f'{role}_id')} (from {where})"
                 for role, (token, where) in self.sources.items() if token and getattr(self, f"add_{role}")]
        return f"vocab {self.vocab_size:,}; adds " + (", ".join(parts) or "no bos or eos")

    def _encode(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def _encode_batch(self, texts):
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self._tok.decode([int(i) for i in ids])

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


# Special tokens by the names tokenizers give them, where no file says which is which.
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|endoftext|>")


def _special_tokens(path: str, spec: dict) -> dict[str, tuple[str, str]]:
    """{"bos"|"eos": (token text, where it was read)} from the tokenizer's own files, in HF's order of
    authority: tokenizer_config.json beside it, tokenizer.json's post-processor template, then its special
    tokens by their usual names (GPT-2's one <|endoftext|> is both, as its own config says)."""
    found: dict[str, tuple[str, str]] = {}
    beside = storage.path(path).parent / "tokenizer_config.json"
    try:
        config = json.loads(beside.read_text(encoding="utf-8"))
        for role in ("bos", "eos"):
            value = config.get(f"{role}_token")
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and value:
                found[role] = (value, str(beside))
    except (OSError, ValueError, AttributeError):
        pass
    post = spec.get("post_processor") or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]  # (Llama 3: byte-level, then it)
    template = next((p.get("single") for p in steps if p.get("type") == "TemplateProcessing"), None) or []
    if template:
        first, last = template[0].get("SpecialToken"), template[-1].get("SpecialToken")
        for role, item in (("bos", first), ("eos", last)):
            if item and role not in found:
                found[role] = (item["id"], "its post-processor")
    special = [t["content"] for t in spec.get("added_tokens", []) if t.get("special")]
    for role, names in (("bos", BOS_NAMES), ("eos", EOS_NAMES)):
        name = next((n for n in names if n in special), None)
        if name and role not in found:
            found[role] = (name, "its special tokens")
    return found


def make_tokenizer(c, check_vocab: bool = True) -> Tokenizer:
    """The configured tokenizer; `check_vocab`: refuse one larger than the model's vocab_size."""
    if c.tokenizer_type == "byte":
        tok = ByteTokenizer(c.add_bos, c.add_eos)
    else:
        if not c.tokenizer_path or not storage.path(c.tokenizer_path, "tokenizer_path").is_file():
            raise ConfigError("tokenizer_path", f"{c.tokenizer_path or '(empty)'}: no such file "
                              f"(tokenizer_type={c.tokenizer_type} needs one)")
        if c.tokenizer_type == "sentencepiece":
            tok = SentencePieceTokenizer(c.tokenizer_path, c.add_bos, c.add_eos)
        else:
            tok = HuggingFaceTokenizer(c.tokenizer_path, c.add_bos, c.add_eos, c.hf_bos_token, c.hf_eos_token)
    if check_vocab and tok.vocab_size > c.vocab_size:
        raise ConfigError("vocab_size", f"{c.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tok.vocab_size}); set vocab_size >= {tok.vocab_size}")
    return tok
