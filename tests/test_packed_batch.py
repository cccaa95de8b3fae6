"""The packed layout's inputs (artifact/packed_batch.py), checked against the padded rows they came from."""

import numpy as np
import pytest

from artifact.packed_batch import pack_batch


def _rows(lengths, width):
    ids = np.arange(1, len(lengths) * width + 1).reshape(len(lengths), width)
    mask = (np.arange(width)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    return ids, mask


def test_packs_the_real_tokens_only_with_positions_restarting_per_sequence():
    ids, mask = _rows([3, 1, 4], width=5)
    type_ids = np.where(np.arange(5)[None, :] >= 2, 1, 0).repeat(3, axis=0)
    packed_ids, packed_types, positions, gather, sequence_mask, scatter = pack_batch(ids, mask, type_ids)
    assert packed_ids.tolist() == [1, 2, 3, 6, 11, 12, 13, 14]
    assert packed_types.tolist() == [0, 0, 1, 0, 0, 0, 1, 1]
    assert positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert (sequence_mask == mask).all() and gather.shape == (3, 5)


def test_gather_and_scatter_are_inverse_over_the_real_tokens():
    ids, mask = _rows([2, 5, 1, 3], width=6)
    packed_ids, _, _, gather, sequence_mask, scatter = pack_batch(ids, mask, seq=8)
    assert gather.shape == sequence_mask.shape == (4, 8)
    # each sequence's j-th token, read through gather, is the padded row's j-th token
    assert (np.where(sequence_mask == 1, packed_ids[gather], 0) == np.pad(ids * mask, ((0, 0), (0, 2)))).all()
    # each packed token lands, through scatter, on the [batch * seq] slot it was gathered from
    assert (gather.reshape(-1)[scatter] == np.arange(len(scatter))).all()


def test_pad_tokens_are_appended_and_never_gathered():
    ids, mask = _rows([2, 3], width=3)
    packed_ids, _, positions, gather, sequence_mask, scatter = pack_batch(ids, mask, tokens=8)
    assert len(packed_ids) == len(scatter) == 8 and packed_ids[5:].tolist() == [0, 0, 0]
    assert set(gather[sequence_mask == 1].tolist()) == set(range(5))


@pytest.mark.parametrize("change, message", [
    (lambda ids, mask: (ids, mask[:, ::-1].copy(), {}), "right-padded"),
    (lambda ids, mask: (ids, mask, {"seq": 2}), "does not fit a packed bucket of 2"),
    (lambda ids, mask: (ids, mask, {"tokens": 3}), "do not fit 3 packed rows"),
])
def test_a_batch_that_cannot_be_packed_is_refused(change, message):
    ids, mask, kwargs = change(*_rows([1, 3], width=4))
    with pytest.raises(ValueError, match=message):
        pack_batch(ids, mask, **kwargs)


def test_the_packed_inputs_are_aligned_apart_and_shared_with_the_runtime_as_they_are():
    """pack_batch carves its six arrays from one allocation, each on its own 64-byte line, so the
    runtime takes them without a copy; any other array (unaligned, read-only, strided) is copied."""
    from artifact.loader import _host_tensor
    from artifact.packed_batch import ALIGNMENT

    ids, mask = _rows([3, 1, 4], width=5)
    packed = pack_batch(ids, mask, seq=7, tokens=9)
    for array in packed:
        assert array.dtype == np.int64 and array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in packed)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two overlap
    shared = _host_tensor(packed[0])
    packed[0][0] = 77
    assert shared.numpy()[0] == 77  # the same memory

    block = np.arange(40, dtype=np.int64)
    unaligned = block[1:17] if block[1:].ctypes.data % ALIGNMENT else block[2:18]
    read_only = np.arange(16, dtype=np.int64)
    read_only.flags.writeable = False
    strided = np.broadcast_to(np.arange(8, dtype=np.int64), (2, 8))
    for array in (unaligned, read_only, strided):
        expected = array.copy()
        copied = _host_tensor(array)
        assert (copied.numpy() == expected).all()
        if array.flags.writeable:
            array[...] = -1
            assert (copied.numpy() == expected).all()  # a copy: later writes do not reach it


@pytest.mark.parametrize("length, seq, tokens", [(5, None, None), (3, 8, None), (4, 6, 7), (0, 4, None), (6, None, 9)])
def test_one_sequence_packs_as_it_does_first_in_a_batch(length, seq, tokens):
    """A single sequence takes its own quicker path: it packs to what the same row packs to first in
    a batch beside an empty one (which adds no tokens)."""
    ids, mask = _rows([length, 0], width=6)
    types = np.where(np.arange(6)[None, :] >= 2, 1, 0).repeat(2, axis=0)
    one = pack_batch(ids[:1], mask[:1], types[:1], seq=seq, tokens=tokens)
    two = pack_batch(ids, mask, types, seq=seq, tokens=tokens)
    for alone, first in zip(one, (*two[:3], two[3][:1], two[4][:1], two[5])):
        assert alone.shape == first.shape and (alone == first).all()


@pytest.mark.parametrize("mask, kwargs, message", [
    ([[0, 1, 1, 0]], {}, "right-padded"),
    ([[1, 1, 1, 0]], {"seq": 2}, "does not fit a packed bucket of 2"),
    ([[1, 1, 1, 0]], {"tokens": 2}, "do not fit 2 packed rows"),
])
def test_one_sequence_that_cannot_be_packed_is_refused(mask, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pack_batch(np.arange(4)[None, :], np.array(mask), **kwargs)
