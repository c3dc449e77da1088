"""Embedding step (mamba_ext.cpu.steps.embedding_forward / embedding_backward): the
table lookup h = embedding[tokens] and its scatter-add, against NumPy indexing.
Size letters: M rows (token positions), V vocab, Dm dModel."""
from __future__ import annotations

import numpy as np
import pytest

from mamba_ext.cpu import steps


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_forward_and_backward(rng, dtype):
    V, Dm, M = 11, 6, 40                       # M > V: rows repeat tokens
    emb = rng.standard_normal((V, Dm)).astype(dtype)
    tokens = rng.integers(0, V, M).astype(np.int64)
    h = np.full((M, Dm), np.nan, dtype)
    steps.embedding_forward(h, tokens, emb)
    np.testing.assert_array_equal(h, emb[tokens])
    dh = rng.standard_normal((M, Dm)).astype(dtype)
    demb = np.ones((V, Dm), dtype)              # accumulates
    steps.embedding_backward(demb, dh, tokens)
    want = np.ones((V, Dm))
    np.add.at(want, tokens, dh.astype(np.float64))
    np.testing.assert_allclose(demb, want, rtol=1e-6 if dtype == np.float32 else 1e-14)


def test_ids_outside_the_table_are_named(rng):
    emb = rng.standard_normal((4, 3))
    with pytest.raises(ValueError, match=r"tokens: id 4 at position 1 outside \[0, 4\)"):
        steps.embedding_forward(np.empty((2, 3)), np.array([0, 4]), emb)
    with pytest.raises(ValueError, match="tokens: id -1"):
        steps.embedding_backward(np.zeros((4, 3)), np.zeros((1, 3)), np.array([-1]))
    with pytest.raises(ValueError, match="h"):
        steps.embedding_forward(np.empty((2, 2)), np.array([0, 1]), emb)
