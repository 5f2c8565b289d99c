"""Mixtures (data_sources): grain's proportional order, realized token shares per weights and stages, an
exact resume, drop and repeat, one eval loss per source, and the config's one-line refusals."""

import json
import random

import jax
import numpy as np
import pytest

from maxtrain.config.keys import ConfigError
from maxtrain.data import pipeline as data, prepare as prepare_lib
from maxtrain.data.mixture import Schedule, counts, proportions

from conftest import SHAKESPEARE, TESTS, TINY
from helpers import run_cli
from test_data import assert_same_batches

REPO = TESTS.parent
MARKERS = {"web": "a", "code": "b", "math": "c"}  # each source's documents repeat one letter: a row says its source


def write_source(path, letter: str, docs: int = 300, seed: int = 0, fmt: str = "txt"):
    rng = random.Random(f"{seed}{letter}")
    texts = [letter * rng.randint(10, 120) for _ in range(docs)]
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    else:
        path.write_text("\n\n".join(texts) + "\n")
    return path


def sources_arg(specs: dict) -> str:
    return "data_sources=" + json.dumps(specs)


@pytest.fixture
def three_sources(tmp_path, tiny_config):
    """web: a prepared corpus; code: text; math: JSON lines with its own text field."""
    write_source(tmp_path / "web.txt", "a")
    prepare_lib.run(tiny_config(f"train_files={tmp_path}/web.txt", f"prepared_dir={tmp_path}/web", "prepare_workers=1"),
                    say=lambda *_: None)
    write_source(tmp_path / "code.txt", "b")
    write_source(tmp_path / "math.jsonl", "c", fmt="jsonl")
    return {"web": {"files": f"{tmp_path}/web", "weight": 0.6},
            "code": {"files": f"{tmp_path}/code.txt", "weight": 0.3},
            "math": {"files": f"{tmp_path}/math.jsonl", "text_field": "body", "weight": 0.1}}


def one_device():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


def host(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


def test_the_order_is_grains_proportional_mixing():
    import grain
    props = proportions([0.5, 0.3, 0.2])  # (grain scales its own to the smallest = 100: the same ratios here)
    mixed = grain.MapDataset.mix([grain.MapDataset.range(10**9).map(lambda x, i=i: (i, x)) for i in range(3)],
                                 list(props))
    k = np.arange(3000)
    before, after = counts(k, props), counts(k + 1, props)
    source = np.argmax(after - before, axis=0)
    assert [mixed[int(i)] for i in k] == [(int(s), int(before[s, i])) for i, s in zip(k, source)]


def test_ranks_cover_each_source_once_and_drop_reweights():
    """Under drop, each source's rows are drawn once each (ranks 0, 1, ... without gaps or repeats) until it
    is used up; the others then share its weight; the data ends with the last."""
    s = Schedule(["a", "b", "c"], [(0, [0.7, 0.2, 0.1]), (40, [0.2, 0.4, 0.4])], 8, 0, sizes=[3000, 200, 90])
    seen = {0: [], 1: [], 2: []}
    step = 0
    while not s.ended(step):
        source, rank = s.assign(step)
        for i, r in zip(source.tolist(), rank.tolist()):
            seen[i].append(r)
        step += 1
    for i, size in enumerate([3000, 200, 90]):
        assert sorted(seen[i]) == list(range(len(seen[i]))) and size - 8 < len(seen[i]) <= size
    what = [w for _, w in s.events]
    assert what[0].startswith("c used up") and what[1].startswith("b used up") and what[-1].endswith("data ends")
    assert s.weights(step - 1) == [1.0, 0.0, 0.0]


@pytest.mark.slow
def test_realized_token_shares_follow_the_weights_and_the_stages(tiny_config, three_sources):
    """2,000 batches of 8 rows: each source's share of the tokens (by the letter its rows hold) within 1%
    (absolute) of its weight, before and after the stage at step 1,000; the step's source ids agree."""
    stage = {"start_step": 1000, "weights": {"web": 0.2, "code": 0.3, "math": 0.5}}
    c = tiny_config(sources_arg(three_sources), f"data_stages=[{json.dumps(stage)}]", "vocab_size=384",
                    "per_device_batch_size=8", devices=jax.devices()[:1])
    lines = []
    it, evals = data.make_iterators(c, one_device(), lines.append)
    assert evals == {}
    assert lines[0].startswith("data: a mixture of 3 sources") and "web 0.6 (" in lines[0]
    assert lines[1] == "data: from step 1,000: web 0.2, code 0.3, math 0.5"
    letters = np.array([ord(x) + 3 for x in "abc"])  # the byte tokenizer's ids: byte + 3
    shares = np.zeros((2, 3))
    for step in range(2000):
        b = host(next(it))
        drawn = b["segment_ids"] > 0
        row_source = np.argmax((b["inputs"][:, :, None] == letters).any(axis=1), axis=1)
        np.testing.assert_array_equal(b["source_ids"][:, 0], row_source)
        shares[step // 1000] += np.bincount(row_source, weights=drawn.sum(axis=1), minlength=3)
    it.close()
    shares /= shares.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(shares[0], [0.6, 0.3, 0.1], atol=0.01)
    np.testing.assert_allclose(shares[1], [0.2, 0.3, 0.5], atol=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["thread", "2 workers", "prepared only"])
def test_a_mixture_resumes_from_its_state_exactly(tiny_config, three_sources, kind):
    """On a 4-device mesh: batches after a saved position equal an uninterrupted run's, bitwise (worker
    processes make the batches a thread makes; prepared sources alone are read by grain's threads, by step);
    another mixture's position is refused."""
    workers = 2 if kind == "2 workers" else 0
    if kind == "prepared only":
        three_sources = {name: dict(three_sources["web"], weight=w) for name, w in zip(three_sources, (5, 3, 2))}
    c = tiny_config(sources_arg(three_sources), "vocab_size=384", f"grain_worker_count={workers}",
                    "per_device_batch_size=2", devices=jax.devices()[:4])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    it = data.make_iterator(c, sharding)
    first = [host(next(it)) for _ in range(7)]
    state = json.loads(json.dumps(it.get_state()))
    rest = [host(next(it)) for _ in range(6)]
    resumed = data.make_iterator(c, sharding)
    resumed.set_state(state)
    assert_same_batches(rest, [host(next(resumed)) for _ in range(6)])
    if workers:
        thread = data.make_iterator(c.replace(grain_worker_count=0), sharding)
        assert_same_batches(first + rest, [host(next(thread)) for _ in range(13)])
        thread.close()
    other = dict(three_sources)
    del other["math"]
    if kind == "prepared only":
        assert state["lanes"] == [[]] * 8 and state["step"] == 7
    with pytest.raises(ValueError, match="saved for the sources web, code, math"):
        data.make_iterator(tiny_config(sources_arg(other), "vocab_size=384", devices=jax.devices()[:4]),
                           sharding).set_state(state)
    for x in (it, resumed):
        x.close()


def test_a_mixture_of_one_reads_its_source_and_repeats_it(tiny_config, tmp_path):
    write_source(tmp_path / "few.txt", "a", docs=12)
    c = tiny_config(sources_arg({"few": {"files": f"{tmp_path}/few.txt", "weight": 2}}), "vocab_size=384",
                    "per_device_batch_size=4", devices=jax.devices()[:1])
    lines = []
    it = data.make_iterators(c, one_device(), lines.append)[0]
    assert lines[1] == "data: the weights of data_sources sum to 2: normalized to few 1"
    for _ in range(40):  # 12 documents of ~65 letters: ~25 rows of 32, read again and again
        b = host(next(it))
        assert set(np.unique(b["inputs"][b["segment_ids"] > 0])) <= {ord("a") + 3, 1, 2}  # and bos, eos
    assert it.reader.epochs(it.position)["few"] >= 1
    it.close()


@pytest.mark.parametrize("args, line", [
    ({"web": {"files": "W", "weight": -1}}, "data_sources.web.weight: must be a finite number >= 0, got -1"),
    ({"web": {"files": "W", "weight": 0}}, "data_sources: every weight is 0: give at least one source a positive"),
    ({"web": {"files": "W"}}, "data_sources.web.weight: missing"),
    ({"web": {"files": "W", "weight": 1, "shuffle": True}}, "data_sources.web.shuffle: unknown; a source takes files"),
    ({"web": {"files": "W", "weight": 1, "dataset_type": "csv"}}, "data_sources.web.dataset_type: 'csv' is not one of"),
    ({"web": {"files": "W", "weight": 1}, "data_stages": [{"start_step": 5, "weights": {"web": 1, "wiki": 1}}]},
     "data_stages[0].weights: names 'wiki', not a source of data_sources (web)"),
    ({"web": {"files": "W", "weight": 1}, "data_stages": [{"start_step": 9, "weights": {"web": 1}},
                                                         {"start_step": 5, "weights": {"web": 1}}]},
     "data_stages[1].start_step: 5: must be an integer after the previous stage's (9)"),
    ({"web": {"files": "W", "weight": 1}, "data_stages": [{"start_step": 9, "weights": {"web": 0}}]},
     "data_stages[0].weights: every weight is 0"),
    ({"web": {"files": "W", "weight": 1}, "train_files": "x.txt"}, "train_files: 'x.txt': data_sources replaces it"),
])
def test_bad_mixtures_are_refused_in_one_line_naming_the_key(tiny_config, args, line):
    stages = args.pop("data_stages", None)
    train_files = args.pop("train_files", None)
    extra = ([f"data_stages={json.dumps(stages)}"] if stages else []) + (
        [f"train_files={train_files}"] if train_files else [])
    with pytest.raises(ConfigError) as e:
        tiny_config(sources_arg(args), *extra)
    assert str(e.value).startswith(line), str(e.value)


@pytest.mark.parametrize("args, line", [
    (["data_sources={web: {files: W, weight: .nan}}"], "data_sources.web.weight: must be a finite number >= 0, got nan"),
    (["data_sources={web: {files: W, weight: .inf}, wiki: {files: W, weight: 1}}"],
     "data_sources.web.weight: must be a finite number >= 0, got inf"),
    (["data_sources={web: {files: W, weight: 1}}", "data_stages=[{start_step: 5, weights: {web: .NaN}}]"],
     "data_stages[0].weights.web: must be a finite number >= 0, got nan"),
])
def test_a_weight_that_is_not_a_number_or_infinite_is_refused(tiny_config, args, line):
    """YAML's .nan and .inf are floats: they passed `>= 0` and ended in a traceback in the proportions."""
    with pytest.raises(ConfigError) as e:
        tiny_config(*args)
    assert str(e.value) == line


@pytest.mark.slow
def test_a_source_that_matches_nothing_or_drop_on_streamed_files_exit_2_before_any_run(tmp_path, three_sources):
    bad = dict(three_sources, code={"files": f"{tmp_path}/nothing*.txt", "weight": 0.3})
    proc = run_cli(TINY, sources_arg(bad), "vocab_size=384", f"base_output_directory={tmp_path}/out")
    assert proc.code == 2 and proc.err.strip() == (
        f"config error: data_sources.code.files: no file matches '{tmp_path}/nothing*.txt'"), proc.err
    proc = run_cli(TINY, sources_arg(three_sources), "vocab_size=384", "data_source_exhausted=drop",
                   f"base_output_directory={tmp_path}/out")
    assert proc.code == 2 and proc.err.strip().startswith(
        "config error: data_source_exhausted: drop needs every source prepared"), proc.err
    assert not (tmp_path / "out").exists()


def random_text(path, n: int = 400):
    rng = random.Random(0)
    path.write_text("\n\n".join("".join(chr(rng.randint(33, 126)) for _ in range(rng.randint(80, 200)))
                                for _ in range(n)) + "\n")
    return path


@pytest.mark.slow
def test_each_eval_source_has_its_own_loss(train_tiny, tmp_path, capsys):
    """Trained on Tiny Shakespeare (and a little random text), evaluated on Shakespeare's held-out part and on
    random printable bytes: two losses in the log line and metrics.jsonl, random's near ln(94), above
    Shakespeare's, and the eval loss their token-weighted mean."""
    random_text(tmp_path / "random.txt")
    mix = {"shakespeare": {"files": str(SHAKESPEARE), "weight": 0.9},
           "random": {"files": f"{tmp_path}/random.txt", "weight": 0.1}}
    train_tiny(sources_arg(mix), "vocab_size=384", "eval_split_fraction=0.05", "steps=60", "eval_interval=60",
               "eval_steps=4", "learning_rate=1e-2", "per_device_batch_size=2", "run_name=evals", n_devices=2)
    out = capsys.readouterr().out
    assert "data (eval): each source's held-out part (eval_split_fraction=0.05), evaluated on its own: " \
           "shakespeare, random" in out
    line = [x for x in out.splitlines() if x.startswith("eval ")][-1]
    assert "| shakespeare " in line and "| random " in line
    rows = [json.loads(x) for x in (tmp_path / "evals" / "metrics.jsonl").read_text().splitlines()]
    e = [r for r in rows if "eval/loss" in r][-1]
    shakespeare, noise = e["eval/shakespeare/loss"], e["eval/random/loss"]
    assert shakespeare < 3.0 < np.log(94) - 0.5 < noise, (shakespeare, noise)
    weights = e["eval/shakespeare/tokens"], e["eval/random/tokens"]
    assert e["eval/loss"] == pytest.approx(np.average([shakespeare, noise], weights=weights), rel=1e-6)
    assert e["eval/random/perplexity"] == pytest.approx(np.exp(noise), rel=1e-6)
    shares = [r for r in rows if "data/shakespeare/token_fraction" in r]
    assert len(shares) == 60  # log_period=1
    total = sum(r["data/random/token_fraction"] for r in shares) / len(shares)
    assert abs(total - 0.1) < 0.02


@pytest.mark.parametrize("empty", ["", "\n\n  \n"])  # no text; blank lines only
def test_an_eval_set_with_no_tokens_is_refused_before_the_run_not_scored_a_perfect_loss(tiny_config, tmp_path, empty):
    from maxtrain.data.sources import DataError
    write_source(tmp_path / "a.txt", "a")
    (tmp_path / "none.txt").write_text(empty)
    train = ["dataset_type=text", f"train_files={tmp_path}/a.txt", "vocab_size=384"]
    for evals, named in ((f"eval_files={tmp_path}/none.txt", f"eval_files ({tmp_path}/none.txt)"),
                         ("eval_sources=" + json.dumps({"a": {"files": f"{tmp_path}/a.txt"},
                                                        "none": {"files": f"{tmp_path}/none.txt"}}),
                          f"eval_sources.none ({tmp_path}/none.txt)")):
        c = tiny_config(*train, evals, devices=jax.devices()[:1])
        with pytest.raises(DataError) as e:
            data.make_iterators(c, one_device())
        assert str(e.value) == f"{named}: no tokens to evaluate on (a document needs two tokens or more)"


def test_eval_sources_serve_train_files_too_and_refuse_eval_files_beside(tiny_config, tmp_path):
    write_source(tmp_path / "a.txt", "a")
    write_source(tmp_path / "b.txt", "b")
    evals = "eval_sources=" + json.dumps({"a": {"files": f"{tmp_path}/a.txt"}, "b": {"files": f"{tmp_path}/b.txt"}})
    c = tiny_config("dataset_type=text", f"train_files={tmp_path}/a.txt", "vocab_size=384", evals,
                    "eval_split_fraction=0.5", devices=jax.devices()[:1])
    lines = []
    it, made = data.make_iterators(c, one_device(), lines.append)
    assert list(made) == ["a", "b"] and lines[-2:] == ["data (eval a): streamed 1 file", "data (eval b): streamed 1 file"]
    b = host(next(made["b"]()))
    assert set(np.unique(b["inputs"][b["segment_ids"] > 0])) <= {ord("b") + 3, 1, 2}
    it.close()
    with pytest.raises(ConfigError, match="^eval_files: set either eval_files or eval_sources"):
        tiny_config("dataset_type=text", f"train_files={tmp_path}/a.txt", evals, f"eval_files={tmp_path}/b.txt")
