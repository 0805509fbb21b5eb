"""A communicator's rank, size and fallback are checked before anything is built."""

from __future__ import annotations

import pytest

from fastcomm.comm import GlooCommunicator, ShmCommunicator, Store


@pytest.fixture(scope="module")
def store():
    return Store(is_server=True, timeout=30)


@pytest.mark.parametrize("rank,size,message", [
    (0, 0, "size must be a positive int, got 0"),
    (0, 2.0, "size must be a positive int, got 2.0"),
    (2, 2, r"rank must be an int in \[0, 2\), got 2"),
    (-1, 2, r"rank must be an int in \[0, 2\), got -1"),
    ("0", 2, r"rank must be an int in \[0, 2\), got '0'"),
])
def test_bad_rank_or_size_is_named(store, rank, size, message):
    with pytest.raises(ValueError, match=message):  # before Gloo would wait for its peers
        GlooCommunicator(store.prefixed("bad"), rank, size, 5)


def test_fallback_of_another_kind_or_other_ranks_is_refused(store):
    with pytest.raises(TypeError, match="fallback must be a fastcomm Communicator or None, got "
                                        "str"):
        ShmCommunicator(store.prefixed("kind"), 0, 2, 5, fallback="gloo")
    alone = GlooCommunicator(store.prefixed("alone", rank=0), 0, 1, 5)
    try:
        with pytest.raises(ValueError, match="the fallback must span the same ranks: rank 0 of "
                                             "1, this communicator rank 0 of 2"):
            ShmCommunicator(store.prefixed("other"), 0, 2, 5, fallback=alone)
        # the same ranks: accepted, and closed with the communicator
        with ShmCommunicator(store.prefixed("same", rank=0), 0, 1, 5, fallback=alone) as comm:
            assert comm.fallback is alone
        assert alone.closed
    finally:
        alone.close()
