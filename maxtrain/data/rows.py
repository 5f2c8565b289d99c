"""Rows of a batch from token windows: every reader (prepared shards, streamed files) cuts its tokens into
windows of max_target_length + 1 tokens, each window labelled with the document each token belongs to,
and this module turns them into the model's inputs.

Window w of a packed stream holds tokens [w*L, w*L + L] (consecutive windows share one token), so every
token is a target exactly once. A target from another document than its input (a document boundary inside
the row) has weight zero; segment ids and positions restart at each document, and at each row.
"""

from __future__ import annotations

import numpy as np

# A batch's [batch, length] arrays and their dtypes.
BATCH_DTYPES = {"inputs": np.int32, "targets": np.int32, "positions": np.int32, "segment_ids": np.int32,
                "weights": np.float32}
BATCH_KEYS = tuple(BATCH_DTYPES)


def buffers(n: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """N empty windows of L + 1 tokens for a reader to fill, then `features`: (tokens_NxL1, docs_NxL1, valid_NxL1)."""
    shape = (n, length + 1)
    return np.zeros(shape, np.int32), np.zeros(shape, np.int64), np.zeros(shape, bool)


def features(tokens_NxL1: np.ndarray, docs_NxL1: np.ndarray, valid_NxL1: np.ndarray) -> dict:
    """N windows of L + 1 tokens -> the batch's [N, L] arrays. `docs`: a label per token, equal for tokens of
    one document (and only those, within a row); `valid`: false where the window ran out of data (padding)."""
    n, length = tokens_NxL1.shape[0], tokens_NxL1.shape[1] - 1
    valid_NxL = valid_NxL1[:, :-1]
    same_doc_NxL = docs_NxL1[:, :-1] == docs_NxL1[:, 1:]
    new_doc_NxL = np.ones((n, length), bool)
    new_doc_NxL[:, 1:] = ~same_doc_NxL[:, :-1]
    index_L = np.arange(length, dtype=np.int32)
    doc_start_NxL = np.maximum.accumulate(np.where(new_doc_NxL, index_L, 0), axis=1)
    return {
        "inputs": np.where(valid_NxL, tokens_NxL1[:, :-1], 0).astype(np.int32),
        "targets": np.where(valid_NxL1[:, 1:], tokens_NxL1[:, 1:], 0).astype(np.int32),
        "positions": np.where(valid_NxL, index_L - doc_start_NxL, 0).astype(np.int32),
        "segment_ids": np.where(valid_NxL, np.cumsum(new_doc_NxL, axis=1), 0).astype(np.int32),
        "weights": (same_doc_NxL & valid_NxL & valid_NxL1[:, 1:]).astype(np.float32),
    }


def padding(n: int, length: int) -> dict:
    """N rows of nothing (weight zero everywhere)."""
    return {k: np.zeros((n, length), dtype) for k, dtype in BATCH_DTYPES.items()}


def checksum(batch: dict, xp=np):
    """A fingerprint of a batch: the sum over every position (row r, column c) and field f of (value + 1)
    times an odd multiplier of (r, c, f), mod 2^32. Integer sums are exact in any order, so the figure is
    the same on any mesh and any number of processes; the train step logs it (`batch_checksum` in
    metrics.jsonl) to show which data a step saw. `xp`: numpy on the host, jax.numpy in the step."""
    b, length = batch["inputs"].shape
    index_BxL = xp.arange(b * length, dtype=xp.uint32).reshape(b, length)
    sums = []
    fields = [batch["inputs"], batch["targets"], batch["segment_ids"], batch["positions"], batch["weights"] > 0]
    for f, x in enumerate(fields, 1):
        multiplier_BxL = index_BxL * xp.uint32(2654435761) + xp.uint32((0x9E3779B9 * f) % 2**32) | xp.uint32(1)
        sums.append(xp.sum((x.astype(xp.uint32) + xp.uint32(1)) * multiplier_BxL, dtype=xp.uint32))
    return xp.sum(xp.stack(sums), dtype=xp.uint32)
