"""Tokenizers behind one interface: byte (no file), sentencepiece (.model), huggingface (tokenizer.json)."""

from __future__ import annotations

import numpy as np

from maxtrain.runtime import storage
from maxtrain.config.load import Config
from maxtrain.config.keys import ConfigError


class Tokenizer:
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def __init__(self, add_bos: bool, add_eos: bool):
        self.add_bos, self.add_eos = add_bos, add_eos

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

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

    def decode(self, ids):
        # ids past the 256 bytes (a model's vocabulary larger than this tokenizer's) stand for no text
        data = bytes(int(i) - self.OFFSET for i in ids if self.OFFSET <= int(i) < self.vocab_size)
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str, add_bos: bool, add_eos: bool):
        super().__init__(add_bos, add_eos)
        import sentencepiece
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            if storage.is_url(path):  # sentencepiece reads local files; a URL's bytes are read here
                self._sp.LoadFromSerializedProto(storage.path(path).read_bytes())
            else:
                self._sp.Load(path)
        except (OSError, RuntimeError):
            raise ConfigError("tokenizer_path", f"{path}: cannot load as a sentencepiece model") from None
        self.vocab_size = self._sp.GetPieceSize()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def _encode(self, text):
        return self._sp.EncodeAsIds(text)

    def decode(self, ids):
        return self._sp.DecodeIds([int(i) for i in ids])


class HuggingFaceTokenizer(Tokenizer):
    def __init__(self, path: str, add_bos: bool, add_eos: bool, bos_token: str, eos_token: str):
        super().__init__(add_bos, add_eos)
        import tokenizers
        try:
            if storage.is_url(path):  # tokenizers reads local files; a URL's text is read here
                self._tok = tokenizers.Tokenizer.from_str(storage.path(path).read_text(encoding="utf-8"))
            else:
                self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception:  # the Rust side raises a bare Exception for unparseable files
            raise ConfigError("tokenizer_path", f"{path}: cannot load as a HuggingFace tokenizer.json") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._token_id("hf_bos_token", bos_token, path)
        self.eos_id = self._token_id("hf_eos_token", eos_token, path)

    def _token_id(self, key: str, token: str, path: str) -> int | None:
        """The id of a special token named by its text; a name the vocabulary lacks would silently
        drop every document's bos or eos."""
        if not token:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ConfigError(key, f"{token!r} is not a token of {path}")
        return token_id

    def _encode(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self._tok.decode([int(i) for i in ids])

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


def make_tokenizer(c: Config) -> Tokenizer:
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
    if tok.vocab_size > c.vocab_size:
        raise ConfigError("vocab_size", f"{c.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tok.vocab_size}); set vocab_size >= {tok.vocab_size}")
    return tok
