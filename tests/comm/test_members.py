"""A communicator's rank, size and fallback are checked before anything is built."""

from __future__ import annotations

import pytest

from fastcomm.comm.checks import check_members


class Member:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("rank,size,message", [
    (0, 0, "size must be a positive int, got 0"),
    (0, 2.0, "size must be a positive int, got 2.0"),
    (2, 2, r"rank must be an int in \[0, 2\), got 2"),
    (-1, 2, r"rank must be an int in \[0, 2\), got -1"),
    ("0", 2, r"rank must be an int in \[0, 2\), got '0'"),
])
def test_bad_rank_or_size_is_named(rank, size, message):
    with pytest.raises(ValueError, match=message):
        check_members(rank, size, None, Member)


def test_fallback_of_another_kind_or_other_ranks_is_refused():
    with pytest.raises(TypeError, match="fallback must be a fastcomm Communicator or None, got "
                                        "str"):
        check_members(0, 2, "gloo", Member)
    with pytest.raises(ValueError, match="the fallback must span the same ranks: rank 1 of 2, "
                                         "this communicator rank 0 of 2"):
        check_members(0, 2, Member(1, 2), Member)
    check_members(1, 2, Member(1, 2), Member)  # the same ranks: accepted
    check_members(0, 1, None, Member)
