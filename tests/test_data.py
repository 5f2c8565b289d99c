"""Data: lazy sources of every format, byte-range pieces, rows, streamed lanes, prepared shards, a position
that does not depend on the number of processes, tokenizers, bad input."""

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import corpus
from maxtrain.data import pipeline as data, prepare as prepare_lib, rows as rows_lib, sources
from maxtrain import prepare as prepare_main
from maxtrain.data.prepared import Corpus, PreparedReader
from maxtrain.data.streamed import Stream, StreamedRows
from maxtrain.config.keys import ConfigError
from maxtrain.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, make_tokenizer

from conftest import SHAKESPEARE, TESTS, xla_flags
from helpers import Output, Run, main_in_process, one_line, popen_as_from_a_terminal, run_cli

REPO = TESTS.parent

TEXT = ("dataset_type=text", "vocab_size=384", "max_target_length=16", "per_device_batch_size=1",
        "log_period=1")
BYTES = ByteTokenizer(True, True)


def stream(pieces, rows=4, length=16, window=8, shuffle=True, epochs=-1, packing=True, seed=0, **kw):
    return Stream(tuple(pieces), rows, length, seed, window, shuffle, epochs, packing, "text", BYTES, **kw)


def take(rows_iter, n):
    return [next(rows_iter) for _ in range(n)]


def assert_same_batches(want, got):
    assert len(want) == len(got)
    for a, b in zip(want, got):
        for k in rows_lib.BATCH_KEYS:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_synthetic_batches_are_random_walks_the_same_on_any_mesh(tiny_config):
    from maxtrain.parallel import mesh as mesh_lib
    from maxtrain.training import step as step_lib

    def first_batches(*overrides, devices, state=None):
        c = tiny_config("per_device_batch_size=2", *overrides, devices=devices)
        it = data.make_iterator(c, step_lib.build(c, mesh_lib.make_mesh(c, devices)).batch_sharding)
        if state:
            it.set_state(state)
        got = [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(3)]
        return got, it.get_state(), it

    # 16 rows on 8 devices (2x2x2: rows split 4 ways, each shard made twice), on 4, and on 1.
    meshes = [first_batches("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                            devices=jax.devices()[:8])[0],
              first_batches("ici_fsdp_parallelism=4", "per_device_batch_size=4", devices=jax.devices()[:4])[0],
              first_batches("per_device_batch_size=16", devices=jax.devices()[:1])[0]]
    for other in meshes[1:]:
        for want, got in zip(meshes[0], other):
            for k in want:
                np.testing.assert_array_equal(want[k], got[k])
    b = meshes[0][0]
    assert b["inputs"].shape == (16, 32) and b["inputs"].dtype == np.int32
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])  # targets are the next token
    assert set(np.unique((b["targets"] - b["inputs"]) % 256)) == {1, 2, 3, 4}
    assert len({tuple(r) for r in b["inputs"]}) == 16  # every row its own walk
    assert not np.array_equal(meshes[0][1]["inputs"], b["inputs"])  # and every step
    np.testing.assert_array_equal(b["positions"], np.broadcast_to(np.arange(32), (16, 32)))
    assert np.all(b["segment_ids"] == 1) and np.all(b["weights"] == 1)
    # Resuming from the state continues the sequence.
    _, state, _ = first_batches("per_device_batch_size=16", devices=jax.devices()[:1])
    assert state == {"step": 3}
    resumed, _, _ = first_batches("per_device_batch_size=16", devices=jax.devices()[:1], state={"step": 1})
    np.testing.assert_array_equal(resumed[0]["inputs"], meshes[2][1]["inputs"])


# ---- sources: every format, lazily; a file's pieces read as the whole file ---------------------

def test_every_format_reads_its_documents_in_order(tmp_path):
    docs = corpus.paragraphs()[:40]
    for fmt in corpus.FORMATS:
        path = corpus.write(tmp_path / "doc", docs, fmt)
        (piece,) = sources.pieces([str(path)], "text")
        assert list(sources.documents(piece, "text")) == docs, fmt
        assert list(sources.documents(piece, "text", skip=33)) == docs[33:], fmt


def test_pieces_of_a_file_read_as_the_whole_file(tmp_path):
    """A line or paragraph belongs to the piece its first byte is in, whatever the piece size and line ends."""
    rng = random.Random(0)
    for trial in range(150):
        nl = rng.choice(["\n", "\r\n"])
        paras = [nl.join("".join(rng.choice("ab \r") for _ in range(rng.randint(0, 6)))
                         for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 10))]
        text = nl * rng.randint(0, 2) + "".join(p + nl * rng.randint(2, 4) for p in paras)
        path = tmp_path / "t.txt"
        path.write_bytes(text.encode())
        whole = list(sources.documents(sources.pieces([str(path)], "text")[0], "text"))
        for size in (1, 2, 3, 5, 8):
            parts = sources.pieces([str(path)], "text", piece_bytes=size)
            assert [d for p in parts for d in sources.documents(p, "text")] == whole, (trial, size, text)
        records = [{"text": "x" * rng.randint(0, 5)} for _ in range(rng.randint(0, 8))]
        path = tmp_path / "t.jsonl"
        path.write_text("".join(json.dumps(r) + rng.choice(["\n", "\r\n", "\n\n"]) for r in records))
        for size in (1, 3, 7, 1000):
            parts = sources.pieces([str(path)], "text", piece_bytes=size)
            assert [d for p in parts for d in sources.documents(p, "text")] == [r["text"] for r in records]
    # Tiny Shakespeare in 64 kB pieces: the blank-line paragraphs of the whole text.
    want = [x.strip("\n") for x in SHAKESPEARE.read_text().split("\n\n") if x.strip()]
    parts = sources.pieces([str(SHAKESPEARE)], "text", piece_bytes=1 << 16)
    assert len(parts) == 18 and [d for p in parts for d in sources.documents(p, "text")] == want


def test_formats_go_by_the_file_name():
    assert sources.file_format("a/b.parquet", "text") == ("parquet", "")
    assert sources.file_format("x.JSONL.GZ", "text") == ("jsonl", ".gz")
    assert sources.file_format("x.jsonl.zst", "parquet") == ("jsonl", ".zst")
    assert sources.file_format("x.txt.gz", "parquet") == ("text", ".gz")
    assert sources.file_format("x.array_record", "text") == ("array_record", "")
    assert sources.file_format("shard-0001", "parquet") == ("parquet", "")
    assert sources.file_format("notes.md", "text") == ("text", "")


# ---- rows --------------------------------------------------------------------------------------

def test_rows_mark_documents_and_mask_targets_that_cross_them():
    # Window of 9 tokens (L = 8): document 7 ends after 3 tokens, document 8 runs on; the last token padding.
    tokens = np.array([[10, 11, 12, 20, 21, 22, 23, 24, 0]])
    docs = np.array([[7, 7, 7, 8, 8, 8, 8, 8, 0]])
    valid = np.array([[True] * 8 + [False]])
    b = rows_lib.features(tokens, docs, valid)
    np.testing.assert_array_equal(b["inputs"][0], [10, 11, 12, 20, 21, 22, 23, 24])
    np.testing.assert_array_equal(b["targets"][0], [11, 12, 20, 21, 22, 23, 24, 0])
    np.testing.assert_array_equal(b["weights"][0], [1, 1, 0, 1, 1, 1, 1, 0])  # 12 -> 20 crosses; 24 -> end
    np.testing.assert_array_equal(b["segment_ids"][0], [1, 1, 1, 2, 2, 2, 2, 2])
    np.testing.assert_array_equal(b["positions"][0], [0, 1, 2, 0, 1, 2, 3, 4])
    pad = rows_lib.features(tokens, docs, np.zeros_like(valid))
    assert not pad["weights"].any() and not pad["segment_ids"].any() and not pad["inputs"].any()


def test_the_checksum_sees_every_field_and_every_place():
    b = rows_lib.features(np.arange(18).reshape(2, 9) % 7, np.zeros((2, 9), int), np.ones((2, 9), bool))
    base = int(rows_lib.checksum(b))
    for key in ("inputs", "targets", "segment_ids", "positions"):
        changed = {k: v.copy() for k, v in b.items()}
        changed[key][1, 3] += 1
        assert int(rows_lib.checksum(changed)) != base, key
    swapped = {k: v[::-1].copy() for k, v in b.items()}  # the same rows in another order
    assert int(rows_lib.checksum(swapped)) != base
    import jax.numpy as jnp
    assert int(rows_lib.checksum({k: jnp.asarray(v) for k, v in b.items()}, jnp)) == base


# ---- streamed files: lanes --------------------------------------------------------------------

SETTINGS = [dict(rows=4, window=7), dict(rows=8, window=3), dict(rows=3, window=50, packing=False),
            dict(rows=6, window=1)]


@pytest.mark.parametrize("kw", SETTINGS, ids=["4rows", "8rows_more_than_pieces", "unpacked", "no_shuffle_window"])
def test_streamed_rows_resume_from_any_process_count(tmp_path, kw):
    """The position after batch 12, saved as JSON, resumes the next 18 batches exactly, on one process or
    split between two (each with its own rows)."""
    files = corpus.make(tmp_path, 5, 30)
    pieces = sources.pieces(sorted(str(p) for p in tmp_path.iterdir()), "text", piece_bytes=4000)
    s = stream(pieces, **kw)
    rows = s.rows
    straight = take(StreamedRows(s, range(rows), None, "any"), 30)
    state = json.loads(json.dumps(straight[11][1]))
    half = rows // 2
    first = StreamedRows(s, range(half), state[:half] + [None] * (rows - half), "any")
    second = StreamedRows(s, range(half, rows), [None] * half + state[half:], "any")
    for want, a, b in zip(straight[12:], take(first, 18), take(second, 18)):
        assert_same_batches([want[0]], [{k: np.concatenate([a[0][k], b[0][k]]) for k in a[0]}])
    assert sum(len(d) for d in files) == 150


@pytest.mark.parametrize("files,rows", [(7, 3), (2, 5)], ids=["more_pieces", "lanes_share_pieces"])
def test_an_epoch_reads_every_document_once(tmp_path, files, rows):
    docs = [d for f in corpus.make(tmp_path, files, 20, formats=("jsonl", "parquet")) for d in f]
    pieces = sources.pieces(sorted(str(p) for p in tmp_path.iterdir()), "text")
    s = stream(pieces, rows=rows, length=4096, window=6, epochs=1, packing=False)
    seen = []
    it = StreamedRows(s, range(rows), None, "all")
    for batch, _ in it:
        seen += [BYTES.decode(r[w > 0]) for r, w in zip(batch["inputs"], batch["weights"]) if w.any()]
    assert sorted(seen) == sorted(docs)  # a row is one document: bos and its bytes, each predicting the next


def test_the_shuffle_is_seeded(tmp_path):
    corpus.make(tmp_path, 4, 30)
    pieces = sources.pieces(sorted(str(p) for p in tmp_path.iterdir()), "text")
    a, b, other = (take(StreamedRows(stream(pieces, seed=seed), range(4), None, "any"), 3) for seed in (0, 0, 1))
    assert_same_batches([x for x, _ in a], [x for x, _ in b])
    assert not np.array_equal(a[0][0]["inputs"], other[0][0]["inputs"])


def test_held_out_documents_are_the_rest_of_train(tmp_path):
    docs = corpus.make(tmp_path, 3, 200, formats=("jsonl",))
    pieces = sources.pieces(sorted(str(p) for p in tmp_path.iterdir()), "text")

    def read(eval_side):
        s = stream(pieces, rows=3, length=4096, epochs=1, packing=False, shuffle=False, holdout=0.2,
                   eval_side=eval_side)
        return [BYTES.decode(r[w > 0]) for b, _ in StreamedRows(s, range(3), None, "all")
                for r, w in zip(b["inputs"], b["weights"]) if w.any()]
    train, held = read(False), read(True)
    everything = sorted(d for f in docs for d in f)
    assert sorted(train + held) == everything
    assert 0.13 < len(held) / len(everything) < 0.27


# ---- prepared shards --------------------------------------------------------------------------

def prepare(tiny_config, tmp_path, *overrides, files=None):
    out = tmp_path / "tok"
    c = tiny_config(f"train_files={files or tmp_path / 'corpus' / '*'}", f"prepared_dir={out}", "prepare_workers=2",
                    *overrides)
    lines = []
    return prepare_lib.run(c, say=lines.append), out, lines


def test_prepare_writes_every_documents_tokens_in_order(tiny_config, tmp_path):
    docs = [d for f in corpus.make(tmp_path / "corpus", 6, 25) for d in f]  # every format once
    manifest, out, lines = prepare(tiny_config, tmp_path)
    assert manifest["documents"] == len(docs) == 150 and len(manifest["shards"]) == 6
    assert lines[-1].startswith("done: 150 documents, ") and "tokens/s" in lines[-1]
    c = Corpus(str(out))
    want = np.concatenate(BYTES.encode_batch(docs))
    np.testing.assert_array_equal(c._span(0, c.tokens)[0], want)
    assert c.tokenizer == BYTES.identity() and c.tokens == manifest["tokens"] == len(want)
    # document d is the d-th document of the files in sorted order
    for d in (0, 37, 149):
        np.testing.assert_array_equal(c.document(d, 10_000), BYTES.encode(docs[d]))


def test_an_interrupted_prepare_resumes_where_it_stopped(tiny_config, tmp_path):
    corpus.make(tmp_path / "corpus", 5, 20, formats=("jsonl", "txt"))
    manifest, out, _ = prepare(tiny_config, tmp_path)
    before = {p.name: p.read_bytes() for p in (out / "shards").iterdir()}
    # As if stopped after the first two shards: later records, and the manifest, missing; a partial write left.
    (out / "manifest.json").unlink()
    for name in ("00002", "00003", "00004"):
        (out / "shards" / f"{name}.json").unlink()
    (out / "shards" / "00003.tokens").write_bytes(b"\0" * 7)
    again, _, lines = prepare(tiny_config, tmp_path)
    assert "2 pieces done before, resuming" in lines[0]
    assert again == manifest and {p.name: p.read_bytes() for p in (out / "shards").iterdir()} == before
    _, _, lines = prepare(tiny_config, tmp_path)
    assert lines == [f"nothing to do: {out} is prepared (100 documents, {manifest['tokens']:,} tokens in 5 shards)"]
    # A finished directory with a shard cut short (a copy that stopped): the same command writes it again.
    (out / "shards" / "00001.tokens").write_bytes(before["00001.tokens"][:100])
    again, _, lines = prepare(tiny_config, tmp_path)
    assert "4 pieces done before, resuming" in lines[0] and again == manifest
    assert {p.name: p.read_bytes() for p in (out / "shards").iterdir()} == before
    # Other inputs into the same directory: refused, nothing changed.
    with pytest.raises(ConfigError, match="prepared_dir: .* holds data prepared from other files"):
        prepare(tiny_config, tmp_path, "add_bos=false")


def test_prepared_rows_visit_every_window_once_an_epoch(tiny_config, tmp_path):
    corpus.make(tmp_path / "corpus", 3, 10)
    _, out, _ = prepare(tiny_config, tmp_path)
    c = tiny_config("dataset_type=prepared", f"train_files={out}", "max_target_length=64", "per_device_batch_size=4",
                    devices=jax.devices()[:1])
    corp = Corpus(str(out))
    n = corp.windows(64)
    reader = PreparedReader(corp, c, range(4), 0, n, train=True)
    for epoch in range(2):
        order = [reader.shuffled(epoch * n + i) for i in range(n)]
        assert sorted(order) == list(range(n))
    assert [reader.shuffled(i) for i in range(n)] != [reader.shuffled(n + i) for i in range(n)]
    # A row is its window: tokens w*L .. w*L + L, consecutive windows sharing one token.
    b = reader.batch(3)
    w = reader.shuffled(3 * 4 + 1)
    np.testing.assert_array_equal(b["inputs"][1], corp._span(w * 64, w * 64 + 64)[0])
    np.testing.assert_array_equal(b["targets"][1][:-1], corp._span(w * 64 + 1, w * 64 + 64)[0])


def test_a_shards_documents_are_found_with_few_reads(tmp_path):
    """Each token's document, from offsets read a few at a time (a guess from the mean length, else a binary
    search), as a search of all of them gives: skewed lengths, empty documents, a window over many."""
    from maxtrain.data import prepared
    rng = np.random.default_rng(0)
    for trial in range(100):
        lengths = rng.choice([0, 0, 1, 2, 5, 30, 700, 5000], size=rng.integers(1, 4000))
        if trial % 3 == 0:
            lengths[: len(lengths) // 2] = 0  # the guess misses
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("<i8")
        if offsets[-1] == 0:
            continue
        offsets.tofile(tmp_path / "docs")
        read = prepared._Offsets(prepared._Local(str(tmp_path / "docs"), np.dtype("<i8")), "docs")
        for _ in range(10):
            lo = int(rng.integers(0, offsets[-1]))
            hi = int(min(offsets[-1], lo + rng.integers(1, 600)))
            want = np.searchsorted(offsets, np.arange(lo, hi), side="right") - 1
            np.testing.assert_array_equal(read.documents(lo, hi), want)


def test_prepared_batches_depend_on_the_step_alone(tiny_config, tmp_path):
    corpus.make(tmp_path / "corpus", 2, 40)
    _, out, _ = prepare(tiny_config, tmp_path)
    c = tiny_config("dataset_type=prepared", f"train_files={out}", "per_device_batch_size=4", devices=jax.devices()[:1])
    corp = Corpus(str(out))
    whole = PreparedReader(corp, c, range(4), 0, corp.windows(32), train=True)
    halves = [PreparedReader(corp, c, lanes, 0, corp.windows(32), train=True) for lanes in (range(2), range(2, 4))]
    for step in (0, 5, 999):
        got = [h.batch(step) for h in halves]
        assert_same_batches([whole.batch(step)], [{k: np.concatenate([g[k] for g in got]) for k in got[0]}])


@pytest.mark.parametrize("kind", ["text", "prepared", "text_in_2_workers"])
def test_batches_resume_from_their_state_and_skip_as_read(tiny_config, tmp_path, kind):
    """Through make_iterators, on a 4-device mesh: the saved position resumes exactly; skip(n) is reading n;
    worker processes make the batches a thread makes."""
    corpus.make(tmp_path / "corpus", 4, 30)
    _, out, _ = prepare(tiny_config, tmp_path)
    files = out if kind == "prepared" else f"{tmp_path / 'corpus'}/*"
    workers = 2 if kind == "text_in_2_workers" else 0
    c = tiny_config(f"dataset_type={kind.split('_')[0]}", f"train_files={files}", "vocab_size=384",
                    f"grain_worker_count={workers}", devices=jax.devices()[:4])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    host = lambda b: {k: np.asarray(v) for k, v in b.items()}  # noqa: E731
    it = data.make_iterator(c, sharding)
    first = [host(next(it)) for _ in range(5)]
    state = json.loads(json.dumps(it.get_state()))
    rest = [host(next(it)) for _ in range(4)]
    resumed = data.make_iterator(c, sharding)
    resumed.set_state(state)
    assert_same_batches(rest, [host(next(resumed)) for _ in range(4)])
    skipped = data.make_iterator(c, sharding)
    skipped.skip(5)
    assert_same_batches(rest, [host(next(skipped)) for _ in range(4)])
    assert first[0]["inputs"].shape == (4, 32)
    if workers:
        thread = data.make_iterator(c.replace(grain_worker_count=0), sharding)
        assert_same_batches(first + rest, [host(next(thread)) for _ in range(9)])
        thread.close()
    for x in (it, resumed, skipped):
        x.close()


def test_a_corpus_prepared_with_another_tokenizer_is_refused(tiny_config, tmp_path, hf_tokenizer_json):
    corpus.make(tmp_path / "corpus", 2, 5)
    _, out, _ = prepare(tiny_config, tmp_path)
    c = tiny_config("dataset_type=prepared", f"train_files={out}", "tokenizer_type=huggingface",
                    f"tokenizer_path={hf_tokenizer_json}", "hf_bos_token=<s>", "vocab_size=640")
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
                                          jax.sharding.PartitionSpec())
    with pytest.raises(ConfigError) as e:
        data.make_iterators(c, sharding)
    assert str(e.value).startswith(f"train_files: {out} was prepared with the tokenizer byte (vocab 259, bos 1, eos 2), "
                                   "this config's is huggingface (vocab 600, file sha256 ")


def test_a_tokenizer_is_known_by_its_contents_not_its_path(tmp_path, hf_tokenizer_json):
    copy = tmp_path / "elsewhere.json"
    copy.write_bytes(hf_tokenizer_json.read_bytes())
    a = HuggingFaceTokenizer(str(hf_tokenizer_json), True, True, "<s>", "</s>")
    b = HuggingFaceTokenizer(str(copy), True, True, "<s>", "</s>")
    assert a.identity() == b.identity() and a.identity()["sha256"]
    assert a.identity() != HuggingFaceTokenizer(str(copy), True, False, "<s>", "</s>").identity()
    texts = ["ROMEO: But soft", "", "what light"]
    assert [x.tolist() for x in a.encode_batch(texts)] == [a.encode(t).tolist() for t in texts]


# ---- tokenizers -------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(add_bos=True, add_eos=False)
    ids = tok.encode("héllo")
    assert ids[0] == 1 and ids.max() < tok.vocab_size == 259
    assert tok.decode(ids) == "héllo"
    # a model whose vocabulary is larger (padded, or an imported one) can emit ids that are no byte
    assert tok.decode([*ids, 259, 383, 40000]) == "héllo"


def test_sentencepiece_with_the_llama_mistral_model():
    import mistral_common
    path = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    tok = SentencePieceTokenizer(str(path), add_bos=True, add_eos=True)
    assert tok.vocab_size == 32000 and (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode("To be, or not to be")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) < 12
    assert tok.decode(ids[1:-1]) == "To be, or not to be"


def test_huggingface_tokenizer_json(hf_tokenizer_json):
    tok = HuggingFaceTokenizer(str(hf_tokenizer_json), True, True, "<s>", "</s>")
    assert tok.vocab_size == 600 and (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode("ROMEO: But soft, what light")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids[1:-1]) == "ROMEO: But soft, what light"


def hf_tokenizer(folder, specials, template=None, config=None):
    """A small byte-level BPE tokenizer.json with these special tokens (and post-processor, tokenizer_config)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["ROMEO: But soft, what light through yonder window breaks"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if template:
        tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), processors.TemplateProcessing(
            single=template, special_tokens=[(t, specials.index(t)) for t in specials if t in template])])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder / "tokenizer.json")


def test_huggingface_bos_and_eos_come_from_the_tokenizers_own_files(tmp_path, tiny_config):
    """Llama 3's way (a post-processor template adds bos; eos by its name), GPT-2's (one <|endoftext|>),
    tokenizer_config.json beside it; none at all: one line naming the key. vocab_size left unset is its size."""
    llama = hf_tokenizer(tmp_path / "llama", ["<|begin_of_text|>", "<|end_of_text|>"], "<|begin_of_text|> $A")
    tok = HuggingFaceTokenizer(llama, True, True, "", "")
    assert (tok.bos_id, tok.eos_id) == (0, 1) and tok.describe() == (
        f"vocab {tok.vocab_size}; adds bos '<|begin_of_text|>' = 0 (from its post-processor), eos '<|end_of_text|>' "
        "= 1 (from its special tokens)")
    gpt2 = HuggingFaceTokenizer(hf_tokenizer(tmp_path / "gpt2", ["<|endoftext|>"]), True, True, "", "")
    assert gpt2.bos_id == gpt2.eos_id == 0
    plain = hf_tokenizer(tmp_path / "plain", ["<pad>", "<unk>"])
    with pytest.raises(ConfigError) as e:
        HuggingFaceTokenizer(plain, True, False, "", "")
    assert str(e.value) == (f"hf_bos_token: {plain} names no bos token (no tokenizer_config.json beside it says "
                            "one, nor its post-processor or special tokens): set hf_bos_token=TOKEN, or add_bos=false")
    assert HuggingFaceTokenizer(plain, False, False, "", "").describe().endswith("adds no bos or eos")
    configured = hf_tokenizer(tmp_path / "configured", ["<pad>", "<unk>"],
                              config={"bos_token": {"content": "<unk>"}, "eos_token": "<pad>"})
    tok = HuggingFaceTokenizer(configured, True, True, "", "")
    assert (tok.bos_id, tok.eos_id) == (1, 0) and "(from " + str(tmp_path / "configured" / "tokenizer_config.json") \
        in tok.describe()
    from maxtrain.config import load as config_load
    c = config_load.load(["configs/base.yml", "dataset_type=text", f"train_files={SHAKESPEARE}",
                          "tokenizer_type=huggingface", f"tokenizer_path={llama}"])
    assert c.vocab_size == 300  # the tokenizer's (base.yml's 512 is for synthetic data)
    assert config_load.load(["configs/base.yml", "dataset_type=text", f"train_files={SHAKESPEARE}"]).vocab_size == 259


def test_tokenizer_larger_than_vocab_is_a_config_error(tiny_config, hf_tokenizer_json):
    c = tiny_config("tokenizer_type=huggingface", f"tokenizer_path={hf_tokenizer_json}", "vocab_size=512")
    with pytest.raises(ConfigError) as e:
        make_tokenizer(c)
    assert e.value.key == "vocab_size" and "600" in str(e.value)


# ---- bad input through the CLI: one line naming the file; exit 2 before the run, 1 during it ------

def cli(*args, tmp_path, config="configs/base.yml"):
    return run_cli(config, *TEXT, "steps=2", *args, out=tmp_path / "out", devices=1, timeout=300)


def refused(run, code, expected):
    assert run.code == code, run.err[-1500:]
    assert one_line(run.err).startswith(expected), run.err


@pytest.mark.slow
def test_bad_inputs_name_the_file(tmp_path, tiny_config, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "garbage.model").write_bytes(b"\x00garbage")
    (tmp_path / "garbage.json").write_text("{not a tokenizer")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 broken")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["some text"]}), tmp_path / "nocolumn.parquet")
    gz = corpus.write(tmp_path / "cut", corpus.paragraphs()[:50], "jsonl.gz")
    gz.write_bytes(gz.read_bytes()[:-200])
    corpus.make(tmp_path / "corpus", 2, 10)
    _, prepared, _ = prepare(tiny_config, tmp_path)
    (tmp_path / "notprepared").mkdir()
    damaged = tmp_path / "damaged"
    import shutil
    shutil.copytree(prepared, damaged)
    tokens = damaged / "shards" / "00001.tokens"
    tokens.write_bytes(tokens.read_bytes()[:-2])
    cases = [
        ([f"train_files={tmp_path}/missing*.txt"], "config error: train_files: no file matches"),
        ([f"train_files={SHAKESPEARE}", f"eval_files={tmp_path}/none*.jsonl"], "config error: eval_files: no file matches"),
        ([f"train_files={tmp_path}/bad.jsonl"], f"data error: {tmp_path}/bad.jsonl: line 2 is not a JSON object"),
        ([f"train_files={tmp_path}/nofield.jsonl"], f"data error: {tmp_path}/nofield.jsonl: line 1 has no field 'text'"),
        (["dataset_type=parquet", f"train_files={tmp_path}/bad.parquet"], f"data error: {tmp_path}/bad.parquet: cannot read"),
        ([f"train_files={tmp_path}/nocolumn.parquet"],
         f"data error: {tmp_path}/nocolumn.parquet: no column 'text' (text_field); columns: ['body']"),
        ([f"train_files={gz}"], f"data error: {gz}: cannot read: the compressed file ends early (truncated?)"),
        (["dataset_type=prepared", f"train_files={tmp_path}/notprepared"],
         f"data error: {tmp_path}/notprepared: no manifest.json: not a prepared directory"),
        (["dataset_type=prepared", f"train_files={damaged}"],
         f"data error: {tokens}: {tokens.stat().st_size} bytes where the manifest says {tokens.stat().st_size + 2}"),
        (["dataset_type=prepared", f"train_files={prepared}", "add_eos=false"],
         f"config error: train_files: {prepared} was prepared with the tokenizer byte (vocab 259, bos 1, eos 2), "
         "this config's is byte (vocab 259, bos 1, eos None)"),
        ([f"train_files={SHAKESPEARE}", "tokenizer_type=sentencepiece", f"tokenizer_path={tmp_path}/garbage.model",
          "vocab_size=32000"], f"config error: tokenizer_path: {tmp_path}/garbage.model: cannot load"),
        ([f"train_files={SHAKESPEARE}", "tokenizer_type=huggingface", f"tokenizer_path={tmp_path}/garbage.json"],
         f"config error: tokenizer_path: {tmp_path}/garbage.json: cannot load"),
        ([f"train_files={SHAKESPEARE}", "tokenizer_type=sentencepiece", f"tokenizer_path={tmp_path}/none.model"],
         "config error: tokenizer_path:"),
    ]
    for args, expected in cases:
        if expected.startswith("config error:"):  # found before any device is touched: no process of its own
            argv = [str(REPO / "configs" / "base.yml"), *TEXT, "steps=2", *args,
                    f"base_output_directory={tmp_path / 'out'}"]
            code, err = main_in_process(argv, capsys)
            refused(Run(code, "", err, 0.0), 2, expected)
        else:
            refused(cli(*args, tmp_path=tmp_path), 2, expected)
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gz", "prepared"])
def test_a_file_found_bad_mid_run_stops_it_and_keeps_the_checkpoints(tmp_path, tiny_config, kind):
    """A truncated .gz whose end the rows reach after a few steps, or a prepared shard damaged in place while
    the run reads it: exit 1 in one line naming the file; the checkpoint before it resumes once it is mended."""
    docs = corpus.paragraphs()[:120]
    (tmp_path / "corpus").mkdir()
    if kind == "gz":
        bad = corpus.write(tmp_path / "corpus" / "a", docs, "jsonl.gz")
        good = bad.read_bytes()
        bad.write_bytes(good[: len(good) // 2])
        args = ["dataset_type=text", f"train_files={bad}", "grain_shuffle_buffer_size=4"]
        expected = f"data error: {bad}: cannot read: the compressed file ends early (truncated?)"
    else:
        corpus.write(tmp_path / "corpus" / "a", docs, "jsonl")
        _, out, _ = prepare(tiny_config, tmp_path)
        bad = out / "shards" / "00000.tokens"
        good = bad.read_bytes()
        args = ["dataset_type=prepared", f"train_files={out}", "packing=false"]
        expected = f"data error: {bad}: token id 65535 is outside the vocabulary (259): the shard is damaged"
    run = ("run_name=r", "steps=400", "enable_checkpointing=true", "checkpoint_period=2", "max_target_length=256",
           "per_device_batch_size=2", "data_shuffle_seed=3", *args)
    if kind == "gz":
        proc = cli(*run, tmp_path=tmp_path, config=str(TESTS / "configs" / "tiny.yml"))
    else:  # a global shuffle reads any document first: damage the shard once a checkpoint is saved
        env = dict(os.environ, XLA_FLAGS=xla_flags(1))
        running = subprocess.Popen([sys.executable, "-m", "maxtrain.train", str(TESTS / "configs" / "tiny.yml"),
                                    *TEXT, f"base_output_directory={tmp_path / 'out'}", *run],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        output = Output(running)
        output.wait_for(r"^saved checkpoint ", timeout=300)
        with open(bad, "r+b") as f:  # in place, its size kept: ids past the vocabulary in its second half
            f.seek(len(good) // 2)
            f.write(b"\xff" * (len(good) - len(good) // 2))
        code, lines, err = output.finish(timeout=300)
        proc = Run(code, "".join(x + "\n" for x in lines), err, 0.0)
    refused(proc, 1, expected)
    saved = sorted(int(p.name) for p in (tmp_path / "out" / "r" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and f"saved checkpoint {saved[-1]} " in proc.out
    bad.write_bytes(good)
    proc = cli(*run[:1], "steps=" + str(saved[-1] + 1), *run[2:], tmp_path=tmp_path,
               config=str(TESTS / "configs" / "tiny.yml"))
    assert proc.code == 0 and f"resumed from {tmp_path}/out/r/checkpoints/{saved[-1]}" in proc.out, proc.err


@pytest.mark.slow
def test_shakespeare_eval_loss_goes_down(tmp_path):
    proc = run_cli("configs/shakespeare.yml", "steps=24", "eval_interval=12", "eval_steps=5", "max_target_length=128",
                   "per_device_batch_size=4", "enable_checkpointing=false", "run_name=shakespeare", out=tmp_path,
                   devices=1)
    assert proc.code == 0, proc.err[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "shakespeare" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] < np.log(259)
    assert "perplexity" in proc.out


@pytest.mark.slow
def test_host_memory_does_not_grow_with_the_corpus(tmp_path):
    """A corpus of many files in every format, tens of MB, and one 4x larger: the training process's own peak
    RSS (the kernel's count, os.wait4) is the same within 8%, about 35 MB: the runs' own spread is some 20 MB
    (allocators, threads), while holding the corpus as Python strings, as the readers once did, would add
    more than the large corpus's 50 MB."""
    def peak_rss_mb(corpus_dir):
        env = dict(os.environ, XLA_FLAGS=xla_flags(1))
        proc = subprocess.Popen([sys.executable, "-m", "maxtrain.train", str(TESTS / "configs" / "tiny.yml"),
                                 "dataset_type=text", f"train_files={corpus_dir}/*", "vocab_size=384", "steps=3",
                                 "per_device_batch_size=8", f"base_output_directory={tmp_path / 'out'}",
                                 f"run_name={corpus_dir.name}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=REPO)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        assert status == 0 and "done: 3 steps" in out, out[-2000:]
        return usage.ru_maxrss / 1024
    sizes = {}
    for name, docs_per_file in (("small", 4000), ("large", 16000)):
        corpus.make(tmp_path / name, 24, docs_per_file)  # every format, 4 files of each
        sizes[name] = sum(p.stat().st_size for p in (tmp_path / name).iterdir()) / 1e6
    small, large = peak_rss_mb(tmp_path / "small"), peak_rss_mb(tmp_path / "large")
    print(f"corpus {sizes['small']:.0f} MB: {small:.0f} MB peak RSS; {sizes['large']:.0f} MB: {large:.0f} MB")
    assert sizes["large"] > 3.5 * sizes["small"] > 20  # tens of MB on disk (compressed files are smaller)
    assert abs(large - small) < 0.08 * small


# ---- python -m maxtrain.prepare as a user runs it -------------------------------------------------

def prepare_cli(*args, tmp_path):
    """The prepare command, with Ctrl-C at its default (a suite run in the background would hand it ignored)."""
    return popen_as_from_a_terminal([sys.executable, "-m", "maxtrain.prepare", "configs/base.yml", *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


@pytest.mark.slow
def test_prepare_stopped_by_ctrl_c_resumes_to_the_same_shards(tmp_path, hf_tokenizer_json):
    """Ctrl-C once the first shards are written: exit 130 in one line, no manifest; the same command then
    tokenizes only the rest, and the shards are those of a run never stopped."""
    import signal
    import time
    corpus.make(tmp_path / "corpus", 12, 1500, formats=("jsonl", "txt", "parquet"))
    hf = ("tokenizer_type=huggingface", f"tokenizer_path={hf_tokenizer_json}", "hf_bos_token=<s>", "prepare_workers=1")
    args = (f"train_files={tmp_path}/corpus/*", f"prepared_dir={tmp_path}/tok", *hf)
    proc = prepare_cli(*args, tmp_path=tmp_path)
    deadline = time.time() + 120
    while not (tmp_path / "tok" / "shards" / "00001.json").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "interrupted by Ctrl-C", err[-2000:]
    assert not (tmp_path / "tok" / "manifest.json").exists()
    proc = prepare_cli(*args, tmp_path=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    done_before = int(out.split(" pieces done before")[0].rsplit("; ", 1)[1])
    assert 2 <= done_before < 12 and out.splitlines()[-1].startswith("done: 18,000 documents, ")
    proc = prepare_cli(*args[:1], f"prepared_dir={tmp_path}/straight", *hf, tmp_path=tmp_path)
    assert proc.wait(timeout=300) == 0
    for name in sorted(p.name for p in (tmp_path / "straight" / "shards").iterdir()):
        assert (tmp_path / "tok" / "shards" / name).read_bytes() == (tmp_path / "straight" / "shards" / name).read_bytes()


def test_a_second_prepare_into_a_directory_being_written_is_one_line(tmp_path):
    """Two at once both failed with 'No such file or directory' on each other's shards; now a job holds its
    directory (a lock the kernel drops when its holder ends, killed or not) and a second one says so."""
    corpus.make(tmp_path / "corpus", 2, 20, formats=("txt",))
    args = (f"train_files={tmp_path}/corpus/*", f"prepared_dir={tmp_path}/tok", "prepare_workers=1")
    with prepare_lib._holding(str(tmp_path / "tok")):  # as a prepare running in this process holds it
        second = prepare_cli(*args, tmp_path=tmp_path)
        _, err = second.communicate(timeout=120)
    assert second.returncode == 2 and err == (f"config error: prepared_dir: {tmp_path}/tok is being written by another "
                                              f"maxtrain.prepare (pid {os.getpid()}): wait for it to finish, or choose "
                                              "another prepared_dir\n"), err
    assert not (tmp_path / "tok" / "shards").exists()
    again = prepare_cli(*args, tmp_path=tmp_path)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0 and out.splitlines()[-1].startswith("done: 40 documents, "), err


@pytest.mark.slow
def test_prepare_on_a_full_disk_is_one_line_and_keeps_its_shards(tmp_path):
    from conftest import tmpfs
    corpus.make(tmp_path / "corpus", 8, 2000, formats=("jsonl",))
    with tmpfs(tmp_path / "disk", "size=1m") as disk:
        proc = prepare_cli(f"train_files={tmp_path}/corpus/*", f"prepared_dir={disk}/tok", "prepare_workers=1",
                           tmp_path=tmp_path)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, err
        assert re.fullmatch(rf"prepare error: writing {disk}/tok/shards/\d{{5}}\.tokens failed: No space left on device "
                            r"\[errno 28\]; the shards written so far stay: rerun the same command to go on\n", err), err
        assert not (disk / "tok" / "manifest.json").exists() and not list((disk / "tok" / "shards").glob("*.tmp"))


@pytest.mark.slow
def test_prepare_refuses_bad_requests_in_one_line(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    corpus.make(tmp_path / "corpus", 1, 5)
    cases = [
        ((f"train_files={tmp_path}/corpus/*",), "config error: prepared_dir: is empty; name the directory"),
        ((f"train_files={tmp_path}/none*", f"prepared_dir={tmp_path}/t"), "config error: train_files: no file matches"),
        ((f"train_files={tmp_path}/corpus/*", f"prepared_dir={tmp_path}/afile"),
         f"config error: prepared_dir: {tmp_path}/afile: cannot write"),
        ((f"train_files={tmp_path}/corpus/*", f"prepared_dir={tmp_path}/t", "tokenizer_type=sentencepiece"),
         "config error: tokenizer_path: (empty): no such file"),
        ((f"train_files={tmp_path}/corpus/*", f"prepared_dir={tmp_path}/t", "prepare_workers=0"),
         "config error: prepare_workers: must be positive or -1 (auto), got 0"),
    ]
    for args, expected in cases[1:]:  # in this process: each is refused before any work starts
        code = prepare_main.main([str(REPO / "configs" / "base.yml"), *args])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(expected) and len(err.strip().splitlines()) == 1, (args, err)
    proc = prepare_cli(*cases[0][0], tmp_path=tmp_path)  # and as a user runs it
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.startswith(cases[0][1]) and len(err.strip().splitlines()) == 1, err
    help_ = subprocess.run([sys.executable, "-m", "maxtrain.prepare", "--help"], capture_output=True, text=True, cwd=REPO)
    assert help_.returncode == 0 and help_.stdout.startswith("usage: python -m maxtrain.prepare CONFIG.yml")


def test_the_loop_says_when_the_step_waits_for_data(capsys):
    """The input pipeline's own rate once, early; each logged step's share of time spent waiting for a batch;
    a warning above 10%, at most every 5 minutes."""
    import types
    from maxtrain.observe.data_watch import DataWatch
    batches = types.SimpleNamespace(stats=(0.0, 0, 0.0))
    c = types.SimpleNamespace(global_batch_size=8, max_target_length=128)
    watch = DataWatch(batches, c)
    assert watch.read(10.0, True, 0.1) == {}  # the first logged step starts the window
    batches.stats = (0.5, 1_000_000, 0.2)  # 1M tokens made in 0.5 s of work; 0.2 s waited of the next 10 s
    assert watch.read(20.0, False, 0.1) == {"data_wait_fraction": pytest.approx(0.02)}
    assert capsys.readouterr().out == ("input pipeline: 2,000,000 tokens/s per host on its own; the step consumes "
                                       "10,240 tokens/s per host\n")
    batches.stats = (1.0, 2_000_000, 5.2)  # then 5 s of 10 s waiting
    assert watch.read(30.0, False, 0.1) == {"data_wait_fraction": pytest.approx(0.5)}
    assert capsys.readouterr().out.startswith("warning: the step waited for data 50% of the time since the last log")
    batches.stats = (1.5, 3_000_000, 10.2)
    watch.read(40.0, False, 0.1)
    assert capsys.readouterr().out == ""  # said again only after 5 minutes
    batches.stats = (2.0, 4_000_000, 50.2)  # 40 s of 301
    watch.read(341.0, False, 0.1)
    assert "warning: the step waited for data" in capsys.readouterr().out
    assert DataWatch(types.SimpleNamespace(stats=None), c).read(1.0, False, 0.1) == {}  # synthetic data
