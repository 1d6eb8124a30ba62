"""tools/data_order.py: the held-out split by document, the seeded shuffle per epoch, and a resume from any data
position giving exactly the batches of the uninterrupted stream; documents read by address (data.py)."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from megatrain.tools import data_order
from megatrain.tools.data import Corpus
from megatrain.tools.tokenizer import ByteTokenizer
from megatrain.tools.train_config import TrainConfigError

SEP = ByteTokenizer.separator_id
GOLDEN = 0x9E3779B97F4A7C15


def splitmix64_finalizer(z: int) -> int:
    """Vigna's splitmix64 output function, written out from its published constants."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return z ^ (z >> 31)


def write_corpus(tmp_path, n=23):
    """Documents of different lengths, each made of one letter (its identity), in a .jsonl with blank lines."""
    letters = [chr(ord("A") + i) for i in range(n)]
    lines = [json.dumps({"text": letter * (3 + 5 * i % 17)}) for i, letter in enumerate(letters)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines[:5]) + "\n\n   \n" + "\n".join(lines[5:]) + "\n")
    corpus = Corpus((str(path),), ByteTokenizer())
    return corpus, corpus.addresses(), letters


def stream(corpus, addresses, numbers, position=data_order.Position(), shuffle=True, seed=3, batch=2, seq=16):
    return data_order.TrainingData(corpus, addresses, numbers, seq, batch, SEP, seed, shuffle, position)


def test_addresses_read_back_the_documents_in_corpus_order(tmp_path):
    corpus, addresses, _ = write_corpus(tmp_path)
    assert len(addresses) == 23  # the blank lines are no documents
    read = [corpus.document(int(f), int(w)) for f, w in zip(addresses.file, addresses.where)]
    assert all(np.array_equal(a, b) for a, b in zip(read, corpus.documents()))


def test_shuffle_is_a_seeded_permutation_new_every_epoch():
    numbers = np.arange(1000, dtype=np.int64)
    orders = [data_order.epoch_order(numbers, 7, e, True) for e in range(3)]
    for order in orders:
        assert sorted(order) == list(numbers) and not np.array_equal(order, numbers)
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    assert np.array_equal(orders[1], data_order.epoch_order(numbers, 7, 1, True))       # the seed decides
    assert not np.array_equal(orders[1], data_order.epoch_order(numbers, 8, 1, True))
    assert np.array_equal(data_order.epoch_order(numbers, 7, 1, False), numbers)        # --no-shuffle
    # Integer arithmetic only: these numbers are the same on every machine and numpy version (a change here
    # would make checkpoints resume in another order), and the array path equals splitmix64 on Python ints.
    assert data_order.hash_keys(3, 0, 2, 0).tolist() == [9523871107687072808, 16943748999857591265,
                                                          16431587549569794264]
    assert data_order.hash_keys(2, 7, 1).tolist() == [7084762027518950502, 4767613519079100543]
    base = 0
    for part in (7, 1):
        base = splitmix64_finalizer((base + part * GOLDEN + GOLDEN) % 2**64)
    assert [splitmix64_finalizer((base + i * GOLDEN) % 2**64) for i in (1, 2)] == data_order.hash_keys(2, 7, 1).tolist()
    assert list(data_order.epoch_order(np.arange(8), 0, 0, True)) == list(
        np.argsort(data_order.hash_keys(8, 0, 2, 0), kind="stable"))


def test_held_out_split_is_by_document_fixed_by_the_seed_and_never_trained_on(tmp_path):
    corpus, addresses, letters = write_corpus(tmp_path)
    train, held = data_order.split(len(addresses), 0.2, seed=5)
    assert len(held) == round(0.2 * 23) and sorted([*train, *held]) == list(range(23))
    again_train, again_held = data_order.split(len(addresses), 0.2, seed=5)
    assert np.array_equal(held, again_held) and np.array_equal(train, again_train)
    assert not np.array_equal(held, data_order.split(len(addresses), 0.2, seed=6)[1])
    # Four epochs of training rows hold every training document's letters and none of the held-out ones.
    data = stream(corpus, addresses, train)
    seen = Counter()
    for _, (ids, _labels, _positions) in zip(range(60), data.batches()):
        seen.update(chr(int(t)) for t in ids[0].reshape(-1) if t < 256)
    held_letters = {letters[i] for i in held}
    assert not held_letters & set(seen) and {letters[i] for i in train} == set(seen)
    with pytest.raises(TrainConfigError, match="leaves none to train on"):
        data_order.split(1, 0.3, seed=0)
    assert len(data_order.split(10, 0.01, seed=0)[1]) == 1  # a fraction that is not 0 holds one out at least


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_epoch_trains_each_document_once_and_resume_gives_the_same_batches(tmp_path, shuffle):
    corpus, addresses, letters = write_corpus(tmp_path)
    numbers = np.arange(len(addresses))
    data = stream(corpus, addresses, numbers, shuffle=shuffle)
    straight, positions, epochs = [], [], []
    for _, (ids, labels, _positions) in zip(range(40), data.batches()):
        straight.append((ids.clone(), labels.clone()))
        positions.append(data.state())
        epochs.append(data.epoch)
    assert epochs == sorted(epochs) and epochs[-1] > 3  # several epochs, the counter only goes up
    # Each epoch's rows hold every document's tokens exactly once (plus separators and padding).
    per_epoch: dict[int, Counter] = {}
    previous = data_order.Position()
    for (ids, labels), state in zip(straight, positions):
        rows_here = state["rows_done"] - previous.rows_done
        assert rows_here == 2
        epoch_of_rows = [state["epoch"] if state["epoch_rows"] >= 2 - r else state["epoch"] - 1 for r in range(2)]
        for r, e in enumerate(epoch_of_rows):
            per_epoch.setdefault(e, Counter()).update(chr(int(t)) for t in ids[r] if t < 256)
        previous = data_order.Position(state["epoch"], state["epoch_rows"], state["rows_done"])
    expected = Counter({letters[i]: len(corpus.document(int(addresses.file[i]), int(addresses.where[i])))
                        for i in numbers})
    for e in (1, 2):  # whole epochs in the middle of the stream
        assert per_epoch[e] == expected, e
    if shuffle:  # the rows differ from one epoch to the next
        assert any(not torch.equal(straight[i][0], straight[i + 10][0]) for i in range(10))
    # From the position after any batch, a new stream gives exactly the batches that followed.
    for k in (1, 7, 13, 25):
        position = data_order.TrainingData.resumed_position(positions[k - 1], len(numbers))
        resumed = stream(corpus, addresses, numbers, position, shuffle=shuffle)
        for (ids, labels, _), (want_ids, want_labels) in zip(resumed.batches(), straight[k:k + 8]):
            assert torch.equal(ids, want_ids) and torch.equal(labels, want_labels)
    with pytest.raises(TrainConfigError, match="now holds 22 document"):
        data_order.TrainingData.resumed_position(positions[3], 22)


def test_a_memory_mapped_corpus_is_shuffled_by_rows_of_its_array(tmp_path):
    docs = np.repeat(np.arange(50, dtype=np.uint16)[:, None], 8, axis=1)  # document i: eight tokens i
    np.save(tmp_path / "tokens.npy", docs)
    corpus = Corpus((str(tmp_path / "tokens.npy"),), ByteTokenizer())
    addresses = corpus.addresses()
    assert len(addresses) == 50
    data = stream(corpus, addresses, np.arange(50), seq=9, batch=1)
    first = [int(ids[0, 0]) for _, (ids, _labels, _positions) in zip(range(50), data.batches())]
    assert sorted(first) == list(range(50)) and first != list(range(50))  # one document per row, shuffled
