"""Sequence packing (tools/packing.py): every token once and in order, boundaries marked, padding ignored."""
from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st

from megatrain.tools.packing import IGNORE_INDEX, batches, pack, repeat_epochs

SEP = 1000
PAD = 1001

documents = st.lists(st.lists(st.integers(0, 999), min_size=0, max_size=40), min_size=0, max_size=12)


@given(docs=documents, seq_len=st.integers(1, 17))
def test_packing_keeps_every_token_once_in_order_with_boundaries(docs, seq_len):
    rows = list(pack((np.array(d, dtype=np.int64) for d in docs), seq_len, SEP, pad_id=PAD))
    expected = [t for d in docs for t in d + [SEP]]
    assert all(ids.shape == (seq_len,) and labels.shape == (seq_len,) for ids, labels in rows)
    # Exactly the documents, each followed by the separator, in order: nothing lost, repeated or reordered.
    real = [int(t) for ids, labels in rows for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]
    assert real == expected
    # Rows hold no more than needed: only the last can carry padding.
    assert len(rows) == -(-len(expected) // seq_len)
    for i, (ids, labels) in enumerate(rows):
        padded = labels == IGNORE_INDEX
        if i < len(rows) - 1:
            assert not padded.any()
        # Padding is a suffix, its ids are the pad id, and every other label is its input id.
        n = int((~padded).sum())
        assert padded[n:].all() and not padded[:n].any()
        assert (ids[n:] == PAD).all()
        assert (labels[:n] == ids[:n]).all()
    # No row crosses a document boundary without the separator: where one document's tokens end inside
    # a row and another's begin, a SEP stands between them (checked on the flat stream with document ids).
    owner = [k for k, d in enumerate(docs) for _ in d + [SEP]]
    flat = real
    for j in range(1, len(flat)):
        if owner[j] != owner[j - 1]:
            assert flat[j - 1] == SEP


def test_long_document_spans_rows_and_memmap_slices(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(25, dtype=np.uint16))
    doc = np.load(path, mmap_mode="r")
    rows = list(pack([doc], 10, SEP))
    assert [r[0].tolist() for r in rows] == [list(range(10)), list(range(10, 20)),
                                             list(range(20, 25)) + [SEP] + [SEP] * 4]
    assert rows[-1][1].tolist() == list(range(20, 25)) + [SEP] + [IGNORE_INDEX] * 4


def test_batches_skip_rows_and_epochs():
    docs = [np.arange(7), np.arange(5)]
    stream = pack(repeat_epochs(lambda: iter(docs)), 4, 99)
    it = batches(stream, 2)
    all_rows = [next(it)[0] for _ in range(5)]
    resumed = batches(pack(repeat_epochs(lambda: iter(docs)), 4, 99), 2, skip_rows=4)
    assert (next(resumed)[0] == all_rows[2]).all()
    # The epochs repeat the corpus: rows of 4 over doc0 SEP doc1 SEP (14 tokens) again and again.
    flat = np.concatenate([b.flatten() for b in all_rows]).tolist()
    cycle = list(range(7)) + [99] + list(range(5)) + [99]
    assert flat == (cycle * 3)[:len(flat)]
    assert list(repeat_epochs(lambda: iter([]))) == []
    # A finite pass: the last incomplete batch is dropped.
    finite = list(batches(pack(repeat_epochs(lambda: iter(docs), max_epochs=1), 4, 99), 3))
    assert len(finite) == 1 and finite[0][0].shape == (3, 4)
