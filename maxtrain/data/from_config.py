"""From the config to readers: the train reader (train_files, or a mixture of data_sources) and the eval
readers by name (eval_files or eval_sources, or the held-out part of each train source), with the lines
that say what they read. Bad input is found here, before anything is written: one line naming the key or
the file."""

from __future__ import annotations

import dataclasses

import numpy as np

from maxtrain.data import sources
from maxtrain.data.mixture import Mixture, MixtureReader, Schedule
from maxtrain.data.prepared import MANIFEST, Corpus, PreparedReader
from maxtrain.data.sources import DataError
from maxtrain.data.streamed import Stream, StreamedReader
from maxtrain.data.tokenizer import Tokenizer
from maxtrain.runtime import storage
from maxtrain.runtime.errors import ConfigError
from maxtrain.runtime.wording import counted


def _check_tokenizer(corpus, tokenizer: Tokenizer, key: str) -> None:
    def describe(t: dict) -> str:
        file = f", file sha256 {t['sha256'][:12]}" if t.get("sha256") else ""
        return f"{t['type']} (vocab {t['vocab_size']}{file}, bos {t['bos_id']}, eos {t['eos_id']})"
    if corpus.tokenizer != tokenizer.identity():
        raise ConfigError(key, f"{corpus.directory} was prepared with the tokenizer {describe(corpus.tokenizer)}, "
                          f"this config's is {describe(tokenizer.identity())}: set tokenizer_type, tokenizer_path, "
                          "add_bos and add_eos as when it was prepared")


def _corpus(files: str, key: str, c, tokenizer: Tokenizer):
    """(prepared corpus, its rows) of a prepared directory, checked against the tokenizer."""
    corpus = Corpus(files)
    _check_tokenizer(corpus, tokenizer, key)
    n = corpus.windows(c.max_target_length) if c.packing else corpus.documents
    if n == 0:
        raise DataError(f"{corpus.directory}: {corpus.tokens} tokens, not one row of {c.max_target_length + 1}")
    return corpus, n


def _stream(files: str, key: str, kind: str, text_field: str, c, tokenizer: Tokenizer, **kw):
    """(Stream, the files) of streamed files, checked to hold something to train on."""
    matched = sources.expand(files, key)
    pieces = tuple(sources.pieces(matched, kind))
    if kw.get("shuffle", True) and sources.first_document(
            matched, kind, text_field, lambda t: len(tokenizer.encode(t)) >= 2) is None:
        raise DataError(f"{files}: no document has two tokens or more (add_bos={c.add_bos}, "
                        f"add_eos={c.add_eos}): nothing to train on")
    kw = {"seed": c.data_shuffle_seed, "shuffle": True, "epochs": c.num_epochs, **kw}
    return Stream(pieces, rows=c.global_batch_size, length=c.max_target_length, window=c.grain_shuffle_buffer_size,
                  packing=c.packing, text_field=text_field, tokenizer=tokenizer, **kw), matched


def _eval_reader(files: str, key: str, kind: str, text_field: str, c, tokenizer: Tokenizer, lanes: range):
    """(reader, what it reads) of an eval set: every row once, in order."""
    if kind == "prepared":
        corpus, n = _corpus(files, key, c, tokenizer)
        return PreparedReader(corpus, c, lanes, 0, n, train=False), f"prepared {corpus.describe()}"
    stream, matched = _stream(files, key, kind, text_field, c, tokenizer, shuffle=False, epochs=1)
    return StreamedReader(stream, lanes, "all"), f"streamed {counted(len(matched), 'file')}"


def _prepared(c, tokenizer: Tokenizer, lanes: range):
    corpus, n = _corpus(c.train_files, "train_files", c, tokenizer)
    held = max(1, int(n * c.eval_split_fraction)) if c.eval_split_fraction and not (c.eval_files or c.eval_sources) \
        else 0
    train = PreparedReader(corpus, c, lanes, 0, n - held, train=True)
    unit = "rows" if c.packing else "documents"
    lines = [f"data: prepared {corpus.describe()}; {n - held:,} {unit} of {c.max_target_length} tokens shuffled "
             f"globally by index (data_shuffle_seed={c.data_shuffle_seed})"]
    evals = {}
    if c.eval_files:
        evals[""], what = _eval_reader(c.eval_files, "eval_files", "prepared", c.text_field, c, tokenizer, lanes)
        lines.append(f"data (eval): {what}")
    elif held:
        evals[""] = PreparedReader(corpus, c, lanes, n - held, held, train=False)
        lines.append(f"data (eval): the last {held:,} {unit} (eval_split_fraction={c.eval_split_fraction})")
    return train, evals, lines


def _streamed(c, tokenizer: Tokenizer, lanes: range):
    held = c.eval_split_fraction if not (c.eval_files or c.eval_sources) else 0.0
    stream, files = _stream(c.train_files, "train_files", c.dataset_type, c.text_field, c, tokenizer, holdout=held)
    lines = [f"data: streamed {counted(len(files), 'file')} ({counted(len(stream.pieces), 'piece')}), each row of the "
             "batch reading its own share; file order shuffled every epoch, documents in windows of "
             f"grain_shuffle_buffer_size={c.grain_shuffle_buffer_size} (data_shuffle_seed={c.data_shuffle_seed})"]
    workers = max(c.grain_worker_count, 0)  # -1 is resolved by the platform defaults
    train = StreamedReader(stream, lanes, "any", workers)
    if workers:
        lines[0] += f"; {workers} worker processes read this host's rows"
    evals = {}
    if c.eval_files:
        evals[""], what = _eval_reader(c.eval_files, "eval_files", c.dataset_type, c.text_field, c, tokenizer, lanes)
        lines.append(f"data (eval): {what}")
    elif held:
        evals[""] = StreamedReader(dataclasses.replace(stream, shuffle=False, epochs=1, eval_side=True), lanes, "all")
        lines.append(f"data (eval): the documents a hash of their place holds out (eval_split_fraction={held})")
    return train, evals, lines


# ---------------------------------------------------------------------------------------------
# Mixtures


def source_type(spec: dict, c, key: str) -> str:
    """A source's dataset_type: its own, else the config's (unless synthetic), else a directory that
    maxtrain.prepare wrote is prepared and other files are read by their suffixes."""
    kind = spec.get("dataset_type") or (c.dataset_type if c.dataset_type != "synthetic" else "")
    if kind:
        return kind
    files = spec["files"]
    if "," not in files and not any(ch in files for ch in "*?["):
        try:
            if (storage.path(files, key) / MANIFEST).exists():
                return "prepared"
        except OSError:
            pass
    return "text"


def _seed(c, i: int) -> int:
    """Source i's own shuffle seed (sources shuffled alike would share an order)."""
    return int(np.random.SeedSequence([c.data_shuffle_seed, i]).generate_state(1)[0])


def _mixture(c, tokenizer: Tokenizer, lanes: range):
    names = list(c.data_sources)
    held_fraction = c.eval_split_fraction if not c.eval_sources else 0.0  # (eval_sources: nothing held out)
    readers, sizes, evals, described = [], [], {}, []
    for i, name in enumerate(names):
        spec, key = c.data_sources[name], f"data_sources.{name}.files"
        kind, text_field = source_type(spec, c, key), spec.get("text_field", c.text_field)
        if kind == "prepared":
            corpus, n = _corpus(spec["files"], key, c, tokenizer)
            held = max(1, int(n * held_fraction)) if held_fraction else 0
            readers.append(PreparedReader(corpus, c, lanes, 0, n - held, train=True, seed=_seed(c, i)))
            sizes.append(n - held)
            described.append(f"{counted(n - held, 'row')} prepared")
            if held:
                evals[name] = PreparedReader(corpus, c, lanes, n - held, held, train=False)
        else:
            stream, files = _stream(spec["files"], key, kind, text_field, c, tokenizer, seed=_seed(c, i), epochs=-1,
                                    holdout=held_fraction)
            readers.append(StreamedReader(stream, lanes, "any"))
            sizes.append(None)
            described.append(f"{counted(len(files), 'file')} streamed")
            if held_fraction:
                evals[name] = StreamedReader(dataclasses.replace(stream, shuffle=False, epochs=1, eval_side=True),
                                             lanes, "all")
    drop = c.data_source_exhausted == "drop"
    if drop and None in sizes:
        streamed = [n for n, s in zip(names, sizes) if s is None]
        raise ConfigError("data_source_exhausted", f"drop needs every source prepared (python -m maxtrain.prepare): "
                          f"the size of a streamed source ({', '.join(streamed)}) is known only once it is read")
    weights = [float(c.data_sources[n]["weight"]) for n in names]
    stages = [(0, weights)] + [(int(s["start_step"]), [float(s["weights"][n]) for n in names]) for s in c.data_stages]
    schedule = Schedule(names, stages, c.global_batch_size, c.data_shuffle_seed, sizes if drop else None)
    mixture = Mixture(tuple(names), tuple(readers), schedule, c.max_target_length)
    workers = max(c.grain_worker_count, 0)
    train = MixtureReader(mixture, lanes, workers)

    def weighed(ws) -> str:
        total = sum(ws)
        return ", ".join(f"{n} {w / total:.3g}" for n, w in zip(names, ws))
    unit = "packed rows" if c.packing else "documents (one a row)"
    lines = [f"data: a mixture of {counted(len(names), 'source')}, each row of the batch from one source, in "
             f"{unit}: " + ", ".join(f"{n} {w / sum(weights):.3g} ({d})" for n, w, d in
                                     zip(names, weights, described))
             + (f"; {train.workers} worker processes read this host's rows" if train.workers else "")]
    if abs(sum(weights) - 1) > 1e-9:
        lines.append(f"data: the weights of data_sources sum to {sum(weights):g}: normalized to {weighed(weights)}")
    for start, ws in stages[1:]:
        lines.append(f"data: from step {start:,}: {weighed(ws)}")
    for step, what in schedule.events:
        lines.append(f"data: at step {step:,}: {what}")
    if evals:
        lines.append(f"data (eval): each source's held-out part (eval_split_fraction={held_fraction}), "
                     f"evaluated on its own: {', '.join(evals)}")
    return train, evals, lines


def make_readers(c, tokenizer: Tokenizer, lanes: range):
    """(train reader, {eval name: reader}, the lines that say what they read). The eval name is "" for
    eval_files or a held-out part of train_files."""
    make = _mixture if c.data_sources else _prepared if c.dataset_type == "prepared" else _streamed
    train, evals, lines = make(c, tokenizer, lanes)
    if c.tokenizer_type != "byte":
        lines.insert(0, f"tokenizer: {c.tokenizer_type} {c.tokenizer_path}: {tokenizer.describe()}")
    if c.eval_sources:  # (no split was held out for them)
        evals = {}
        for name, spec in c.eval_sources.items():
            key = f"eval_sources.{name}.files"
            evals[name], what = _eval_reader(spec["files"], key, source_type(spec, c, key),
                                             spec.get("text_field", c.text_field), c, tokenizer, lanes)
            lines.append(f"data (eval {name}): {what}")
    return train, evals, lines
