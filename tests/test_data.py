"""Data: packing, padding, resumable iteration, per-process shares, tokenizers, file formats, errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from maxtrain.data import pipeline as data
from maxtrain.config.keys import ConfigError
from maxtrain.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, make_tokenizer

from conftest import SHAKESPEARE, TESTS

REPO = TESTS.parent

TEXT = ("dataset_type=text", "vocab_size=384", "max_target_length=16", "per_device_batch_size=1",
        "log_period=1")


def batches(c, docs, n, **kw):
    kw = {"process_index": 0, "process_count": 1, "train": True, **kw}
    it = iter(data.make_dataset(c, docs, ByteTokenizer(c.add_bos, c.add_eos), **kw))
    return [next(it) for _ in range(n)], it


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


def test_packing_marks_documents_and_masks_padding(tiny_config, tmp_path):
    c = tiny_config(*TEXT, f"train_files={SHAKESPEARE}", "max_target_length=8", devices=jax.devices()[:1])
    docs = ["ab", "cdef", "ghijklmnopq"]  # with bos/eos: 4, 6 and 13 tokens
    (b,), _ = batches(c, docs, 1, train=False)
    tok = ByteTokenizer(True, True)
    enc = [tok.encode(d) for d in docs]
    row0 = b["inputs"][0]
    # Row 0: doc 0 (3 inputs) + first 5 inputs of doc 1; segment ids 1 then 2; positions restart.
    np.testing.assert_array_equal(row0, np.concatenate([enc[0][:-1], enc[1][:5]]))
    np.testing.assert_array_equal(b["segment_ids"][0], [1, 1, 1, 2, 2, 2, 2, 2])
    np.testing.assert_array_equal(b["positions"][0], [0, 1, 2, 0, 1, 2, 3, 4])
    # Targets are the next token inside the same document: never the next document's first token.
    np.testing.assert_array_equal(b["targets"][0], np.concatenate([enc[0][1:], enc[1][1:6]]))
    assert b["targets"][0][2] == tok.eos_id
    assert b["weights"].shape == (1, 8) and np.all(b["weights"][0] == 1)


def test_padding_is_weighted_zero(tiny_config):
    c = tiny_config(*TEXT, f"train_files={SHAKESPEARE}", "max_target_length=8", "packing=false", devices=jax.devices()[:2])
    (b,), _ = batches(c, ["ab", "a much longer document"] * 4, 1, train=False)
    np.testing.assert_array_equal(b["weights"][0], [1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(b["segment_ids"][0], [1, 1, 1, 0, 0, 0, 0, 0])
    assert b["weights"][1].sum() == 8  # truncated to the row


def test_same_batches_after_restoring_state(tiny_config):
    c = tiny_config(*TEXT, f"train_files={SHAKESPEARE}")
    docs = [f"document number {i} " * (i % 5 + 1) for i in range(50)]
    first, it = batches(c, docs, 7)  # several epochs of these 50 short documents
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    expected = [next(it) for _ in range(5)]
    _, fresh = batches(c, docs, 0)
    fresh.set_state(state)
    for want, got in zip(expected, [next(fresh) for _ in range(5)]):
        for k in want:
            np.testing.assert_array_equal(want[k], got[k])


def test_skip_is_the_same_as_reading_past(tiny_config):
    # A rollback skips the batches that led to a spike: the stream afterwards is the one read past them.
    c = tiny_config(*TEXT, f"train_files={SHAKESPEARE}")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    for make in (lambda: data.make_iterator(c, sharding),
                 lambda: data.SyntheticIterator(c.replace(dataset_type="synthetic"), sharding)):
        read, skipped = make(), make()
        expected = [next(read) for _ in range(6)][3:]
        skipped.skip(3)
        for want, got in zip(expected, [next(skipped) for _ in range(3)], strict=True):
            for k in want:
                np.testing.assert_array_equal(np.asarray(want[k]), np.asarray(got[k]))


def test_shuffle_is_deterministic_and_seeded(tiny_config):
    docs = [f"doc {i}" for i in range(40)]
    c = tiny_config(*TEXT, f"train_files={SHAKESPEARE}", "packing=false")
    a, _ = batches(c, docs, 3)
    b, _ = batches(c, docs, 3)
    other, _ = batches(c.replace(data_shuffle_seed=7), docs, 3)
    assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))
    assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, other))


def test_two_processes_read_disjoint_shares(tiny_config):
    docs = [f"doc {i:03d}" for i in range(32)]
    c = tiny_config(*TEXT, f"train_files={SHAKESPEARE}", "packing=false", "num_epochs=1")
    tok = ByteTokenizer(True, True)
    seen = []
    for index in (0, 1):
        it = iter(data.make_dataset(c, docs, tok, process_index=index, process_count=2, train=True))
        rows = [r for b in it for r in b["inputs"]]  # per-process batch = 8 / 2 = 4 rows
        seen.append({tok.decode(r) for r in rows})
        assert len(rows) == 16
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(docs)


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


def test_tokenizer_larger_than_vocab_is_a_config_error(tiny_config, hf_tokenizer_json):
    c = tiny_config("tokenizer_type=huggingface", f"tokenizer_path={hf_tokenizer_json}", "vocab_size=512")
    with pytest.raises(ConfigError) as e:
        make_tokenizer(c)
    assert e.value.key == "vocab_size" and "600" in str(e.value)


def test_jsonl_parquet_and_array_record_sources(tiny_config, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter
    texts = ["first document", "second document", "third"]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in texts) + "\n")
    pq.write_table(pa.table({"body": texts}), tmp_path / "a.parquet")
    writer = ArrayRecordWriter(str(tmp_path / "a.array_record"), "group_size:1")
    for t in texts:
        writer.write(json.dumps({"body": t}).encode())
    writer.close()
    for kind, name in [("text", "a.jsonl"), ("parquet", "a.parquet"), ("array_record", "a.array_record")]:
        c = tiny_config(f"dataset_type={kind}", f"train_files={tmp_path / name}", "text_field=body")
        docs = data.document_source(c, [str(tmp_path / name)])
        assert [docs[i] for i in range(len(docs))] == texts, kind


def test_text_files_split_on_blank_lines(tmp_path):
    (tmp_path / "t.txt").write_text("one\nline two\n\n\nthree\n")
    assert data._read_text_file(str(tmp_path / "t.txt"), "text") == ["one\nline two", "three"]


# ---- bad input through the CLI: one line naming the file, exit 2, nothing written -------------

def cli(*args, tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return subprocess.run([sys.executable, "-m", "maxtrain.train", "configs/base.yml", *TEXT, "steps=2",
                           f"base_output_directory={tmp_path / 'out'}", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


@pytest.mark.slow
def test_bad_inputs_name_the_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "garbage.model").write_bytes(b"\x00garbage")
    (tmp_path / "garbage.json").write_text("{not a tokenizer")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 broken")
    cases = [
        ([f"train_files={tmp_path}/missing*.txt"], "config error: train_files: no file matches"),
        ([f"train_files={tmp_path}/bad.jsonl"], f"data error: {tmp_path}/bad.jsonl: line 2 is not a JSON object"),
        ([f"train_files={tmp_path}/nofield.jsonl"], f"data error: {tmp_path}/nofield.jsonl: line 1 has no field 'text'"),
        (["dataset_type=parquet", f"train_files={tmp_path}/bad.parquet"], f"data error: {tmp_path}/bad.parquet: cannot read"),
        ([f"train_files={SHAKESPEARE}", "tokenizer_type=sentencepiece", f"tokenizer_path={tmp_path}/garbage.model",
          "vocab_size=32000"], f"config error: tokenizer_path: {tmp_path}/garbage.model: cannot load"),
        ([f"train_files={SHAKESPEARE}", "tokenizer_type=huggingface", f"tokenizer_path={tmp_path}/garbage.json"],
         f"config error: tokenizer_path: {tmp_path}/garbage.json: cannot load"),
        ([f"train_files={SHAKESPEARE}", "tokenizer_type=sentencepiece", f"tokenizer_path={tmp_path}/none.model"],
         "config error: tokenizer_path:"),
    ]
    for args, expected in cases:
        proc = cli(*args, tmp_path=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr[-1500:])
        assert proc.stderr.startswith(expected), (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_shakespeare_eval_loss_goes_down(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.run([sys.executable, "-m", "maxtrain.train", "configs/shakespeare.yml", "steps=40",
                           "eval_interval=20", "eval_steps=5", "max_target_length=128", "per_device_batch_size=4",
                           f"base_output_directory={tmp_path}", "enable_checkpointing=false"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "shakespeare" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] < np.log(259)
    assert "perplexity" in proc.stdout


@pytest.mark.slow
def test_grain_worker_processes_are_deterministic_and_resumable(tiny_config):
    """Each worker packs its own share, so the order depends on grain_worker_count (keep it fixed
    across a resumed run); for a given count it is the same every run and resumes exactly."""
    docs = [f"document {i} " * (i % 7 + 1) for i in range(60)]
    c = tiny_config(*TEXT, f"train_files={SHAKESPEARE}", "grain_worker_count=2")
    first, it = batches(c, docs, 3)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(2)]
    again, _ = batches(c, docs, 3)
    _, resumed = batches(c, docs, 0)
    resumed.set_state(state)
    for want, got in zip(first + expected, again + [next(resumed) for _ in range(2)]):
        for k in want:
            np.testing.assert_array_equal(want[k], got[k])
