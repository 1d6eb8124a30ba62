"""Sequence packing (tools/packing.py): every token once and in order, boundaries marked, padding ignored;
``documents`` rows carry each token's position within its document; ``none`` is one document per row."""
from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st

from megatrain.tools.packing import IGNORE_INDEX, batches, pack, repeat_epochs, resolve_mode

SEP = 1000
PAD = 1001

documents = st.lists(st.lists(st.integers(0, 999), min_size=0, max_size=40), min_size=0, max_size=12)


@given(docs=documents, seq_len=st.integers(1, 17))
def test_packing_keeps_every_token_once_in_order_with_boundaries(docs, seq_len):
    rows = list(pack((np.array(d, dtype=np.int64) for d in docs), seq_len, SEP, pad_id=PAD))
    expected = [t for d in docs for t in d + [SEP]]
    assert all(ids.shape == (seq_len,) and labels.shape == (seq_len,) and pos is None for ids, labels, pos in rows)
    # Exactly the documents, each followed by the separator, in order: nothing lost, repeated or reordered.
    real = [int(t) for ids, labels, _ in rows for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]
    assert real == expected
    # Rows hold no more than needed: only the last can carry padding.
    assert len(rows) == -(-len(expected) // seq_len)
    for i, (ids, labels, _) in enumerate(rows):
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
    assert [r.ids.tolist() for r in rows] == [list(range(10)), list(range(10, 20)),
                                             list(range(20, 25)) + [SEP] + [SEP] * 4]
    assert rows[-1].labels.tolist() == list(range(20, 25)) + [SEP] + [IGNORE_INDEX] * 4


def test_batches_skip_rows_and_epochs():
    docs = [np.arange(7), np.arange(5)]
    stream = pack(repeat_epochs(lambda: iter(docs)), 4, 99)
    it = batches(stream, 2)
    all_rows = [next(it).input_ids for _ in range(5)]
    resumed = batches(pack(repeat_epochs(lambda: iter(docs)), 4, 99), 2, skip_rows=4)
    assert (next(resumed).input_ids == all_rows[2]).all()
    # The epochs repeat the corpus: rows of 4 over doc0 SEP doc1 SEP (14 tokens) again and again.
    flat = np.concatenate([b.flatten() for b in all_rows]).tolist()
    cycle = list(range(7)) + [99] + list(range(5)) + [99]
    assert flat == (cycle * 3)[:len(flat)]
    assert list(repeat_epochs(lambda: iter([]))) == []
    # A finite pass: the last incomplete batch is dropped.
    finite = list(batches(pack(repeat_epochs(lambda: iter(docs), max_epochs=1), 4, 99), 3))
    assert len(finite) == 1 and finite[0].input_ids.shape == (3, 4) and finite[0].position_ids is None


@given(docs=documents, seq_len=st.integers(1, 17))
def test_documents_rows_are_concat_rows_with_positions_and_unpredicted_document_starts(docs, seq_len):
    arrays = [np.array(d, dtype=np.int64) for d in docs]
    concat = list(pack(iter(arrays), seq_len, SEP, pad_id=PAD))
    rows = list(pack(iter(arrays), seq_len, SEP, pad_id=PAD, mode="documents"))
    assert len(rows) == len(concat)
    # Which document each token of the stream belongs to (doc + SEP), and its index in the document.
    owner = [k for k, d in enumerate(docs) for _ in d + [SEP]]
    index = [i for d in docs for i in range(len(d) + 1)]
    for r, ((ids, labels, pos), (c_ids, c_labels, _)) in enumerate(zip(rows, concat)):
        assert (ids == c_ids).all() and pos is not None and pos.shape == (seq_len,)
        for t in range(seq_len):
            j = r * seq_len + t
            if j >= len(owner):  # padding: one segment of its own, nothing learned
                first_pad = len(owner) - r * seq_len
                assert pos[t] == t - first_pad and labels[t] == IGNORE_INDEX
                continue
            # The position restarts at each document and at the row start (a continuation is its own segment).
            start = max(r * seq_len, j - index[j])
            assert pos[t] == j - start
            # A document's first token is not predicted (the token before it ends another document).
            assert labels[t] == (IGNORE_INDEX if index[j] == 0 else c_labels[t])


def test_documents_mode_keeps_chat_labels_and_leaves_the_documents_untouched():
    doc = np.array([5, 6, 7], dtype=np.int64)
    pair = (np.array([1, 2, 3]), np.array([IGNORE_INDEX, 2, 3]))
    rows = list(pack(iter([doc, pair]), 5, SEP, mode="documents"))
    assert [r.ids.tolist() for r in rows] == [[5, 6, 7, SEP, 1], [2, 3, SEP, SEP, SEP]]
    assert [r.labels.tolist() for r in rows] == [[IGNORE_INDEX, 6, 7, SEP, IGNORE_INDEX],
                                                 [2, 3, SEP, IGNORE_INDEX, IGNORE_INDEX]]
    assert [r.positions.tolist() for r in rows] == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert doc.tolist() == [5, 6, 7]  # labels are copies where they change, never the document itself


def test_none_mode_is_one_document_per_row_truncated_and_padded():
    docs = [np.arange(3), np.arange(10, 17), (np.array([1, 2]), np.array([IGNORE_INDEX, 2]))]
    rows = list(pack(iter(docs), 5, SEP, pad_id=PAD, mode="none"))
    assert [r.ids.tolist() for r in rows] == [[0, 1, 2, SEP, PAD], [10, 11, 12, 13, 14], [1, 2, SEP, PAD, PAD]]
    assert [r.labels.tolist() for r in rows] == [[0, 1, 2, SEP, IGNORE_INDEX], [10, 11, 12, 13, 14],
                                                 [IGNORE_INDEX, 2, SEP, IGNORE_INDEX, IGNORE_INDEX]]
    assert all(r.positions is None for r in rows)


def test_batches_carry_position_ids_of_documents_rows_and_auto_mode_follows_the_data():
    docs = [np.arange(3), np.arange(5)]
    (batch,) = list(batches(pack(iter(docs), 5, SEP, mode="documents"), 2))
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 3, 4]]
    assert resolve_mode("auto", np.arange(3)) == "concat"
    assert resolve_mode("auto", (np.arange(3), np.arange(3))) == "whole"  # chat records: kept whole
    assert resolve_mode("none", (np.arange(3), np.arange(3))) == "none"
