"""Export of a model trained from scratch: transformers loads the run's tokenizer from the export and encodes
as the run did, config.json has the run's special token ids and context length, and the files are readable
as the umask allows (not 0700 / 0600)."""

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from conftest import SHAKESPEARE, TINY
from maxtrain import convert, train
from maxtrain.data.tokenizer import make_tokenizer

transformers = pytest.importorskip("transformers")

TEXT = "ROMEO: wherefore art thou, héllo <s> 日本\n\n  x"
STEPS = ("enable_checkpointing=true", "steps=2")


def trained(tmp_path, name, *overrides):
    """Trains the tiny config for 2 steps; returns (its config, its step directory)."""
    c = train.load_config([TINY, f"base_output_directory={tmp_path}", f"run_name={name}", *STEPS, *overrides])
    train.train(c)
    return c, tmp_path / name / "checkpoints" / "2"


def export(step_dir, out, capsys, umask=0o022):
    previous = os.umask(umask)
    try:
        code = convert.main(["maxtrain_to_hf", "--checkpoint", str(step_dir), "--out", str(out)])
    finally:
        os.umask(previous)
    return code, capsys.readouterr().err


def modes(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out.parent)): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.iterdir()]}


def as_the_run_encodes(c, text):
    tok = make_tokenizer(c)
    tok.add_eos = False  # as maxtrain.generate encodes a prompt
    return tok.encode(text).tolist()


@pytest.mark.slow
def test_a_run_with_a_tokenizer_json_exports_what_transformers_loads(tmp_path, hf_tokenizer_json, capsys):
    c, step = trained(tmp_path, "hf", "dataset_type=text", f"train_files={SHAKESPEARE}", "vocab_size=640",
                      "tokenizer_type=huggingface", f"tokenizer_path={hf_tokenizer_json}", "hf_bos_token=<s>",
                      "hf_eos_token=</s>")
    code, err = export(step, tmp_path / "out", capsys)
    assert code == 0, err
    out = tmp_path / "out"
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in out.iterdir()}
    hf = json.loads((out / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["max_position_embeddings"]) == (1, 2, c.max_target_length)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.bos_token_id, tok.eos_token_id) == ("<s>", "</s>", 1, 2)
    assert tok(TEXT).input_ids == as_the_run_encodes(c, TEXT)
    assert tok(TEXT).input_ids[0] == 1 and tok.model_max_length == c.max_target_length
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (1, 2)
    # Modes as a plain mkdir / open give them, whatever the umask.
    assert set(modes(out).values()) == {0o755, 0o644} and modes(out)["out"] == 0o755
    code, err = export(step, tmp_path / "out027", capsys, umask=0o027)
    assert code == 0, err
    assert modes(tmp_path / "out027")["out027"] == 0o750
    assert {m for name, m in modes(tmp_path / "out027").items() if name != "out027"} == {0o640}


def test_a_byte_level_run_exports_a_tokenizer_that_spells_it(tmp_path, capsys):
    c, step = trained(tmp_path, "bytes", "dataset_type=text", f"train_files={SHAKESPEARE}", "vocab_size=384")
    code, err = export(step, tmp_path / "out", capsys)
    assert code == 0, err
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (1, 2, 0)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok(TEXT).input_ids == as_the_run_encodes(c, TEXT)  # "<s>" in the text is bytes, as in the run
    assert tok.decode(as_the_run_encodes(c, TEXT), skip_special_tokens=True) == TEXT


@pytest.mark.slow
def test_synthetic_data_has_no_tokenizer_and_a_moved_tokenizer_is_one_line(tmp_path, hf_tokenizer_json, capsys):
    c, step = trained(tmp_path, "synthetic")
    code, err = export(step, tmp_path / "out", capsys)
    assert code == 0, err
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["max_position_embeddings"]) == (None, None, c.max_target_length)
    assert not any(p.name.startswith("tokenizer") for p in (tmp_path / "out").iterdir())

    moved = tmp_path / "tokenizer.json"
    shutil.copy(hf_tokenizer_json, moved)
    _, step = trained(tmp_path, "moved", "dataset_type=text", f"train_files={SHAKESPEARE}", "vocab_size=640",
                      "tokenizer_type=huggingface", f"tokenizer_path={moved}")
    moved.unlink()
    code, err = export(step, tmp_path / "out2", capsys)
    assert code == 2 and err.strip() == (
        f"convert error: the run's tokenizer_path {moved} (in {tmp_path}/moved/config.yml) is not a file: export "
        "writes the run's tokenizer; give --hf_source DIR to take another's")
    assert not (tmp_path / "out2").exists()


@pytest.mark.slow
def test_a_sentencepiece_run_exports_its_model_file(tmp_path, capsys):
    import mistral_common
    model = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"  # Llama/Mistral's
    c, step = trained(tmp_path, "sp", "dataset_type=text", f"train_files={SHAKESPEARE}", "vocab_size=32000",
                      "tokenizer_type=sentencepiece", f"tokenizer_path={model}")
    code, err = export(step, tmp_path / "out", capsys)
    assert code == 0, err
    out = tmp_path / "out"
    assert (out / "tokenizer.model").read_bytes() == model.read_bytes()
    hf = json.loads((out / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (1, 2)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.bos_token_id, tok.eos_token_id) == ("<s>", "</s>", 1, 2)
    ordinary = "ROMEO: wherefore art thou, Romeo? Hello world."
    assert tok(ordinary).input_ids == as_the_run_encodes(c, ordinary)


def test_a_relative_tokenizer_path_is_found_from_another_directory(tmp_path, hf_tokenizer_json, capsys,
                                                                  monkeypatch):
    """The run named its tokenizer relative to where it started; the export runs elsewhere and finds it."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "tok.json").write_bytes(Path(hf_tokenizer_json).read_bytes())
    monkeypatch.chdir(tmp_path / "work")
    c, step = trained(tmp_path, "rel", "dataset_type=text", f"train_files={SHAKESPEARE}", "vocab_size=640",
                      "tokenizer_type=huggingface", "tokenizer_path=tok.json", "hf_bos_token=<s>",
                      "hf_eos_token=</s>")
    expected = as_the_run_encodes(c, TEXT)
    monkeypatch.chdir(tmp_path)
    code, err = export(step, tmp_path / "out", capsys)
    assert code == 0, err
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok(TEXT).input_ids == expected
