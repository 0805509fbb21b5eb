"""fastcomm.comm.calls: one description of a call, its rows and words, its messages."""

import pytest
import torch

from fastcomm.comm.calls import (
    DTYPES,
    OPS,
    REDUCE_OPS,
    Call,
    calls_difference,
    decode,
    describe,
    encode,
    first_difference,
    from_ipc_word,
    from_shm_words,
    ipc_word,
    mismatch_message,
    reduce_name,
    shm_word_a,
    shm_word_b,
    shm_words,
    tensor_call,
    v_call,
)
from fastcomm.comm.types import BitwiseOp, PremulSum, ReduceOp


def a_call(op: str) -> Call:
    """A call of kind ``op`` with the fields that kind uses."""
    if op == "barrier":
        return Call(op)
    if op in ("gather", "scatter", "all_to_all_v", "alltoall", "all_to_all_single"):
        return Call(op, torch.float32, root=1 if op in ("gather", "scatter") else -1,
                    sent=(0, 4, 2), expected=(3, 0, 1))
    reduce_op = "sum" if "reduce" in op else None
    root = 2 if op in ("reduce", "broadcast") else -1
    return Call(op, torch.bfloat16, 4096, reduce_op, root)


@pytest.mark.parametrize("op", OPS)
def test_a_row_decodes_to_its_call(op):
    call = a_call(op)
    assert decode(encode(call)) == call


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduce_op", REDUCE_OPS)
def test_every_dtype_and_reduce_op_round_trips(dtype, reduce_op):
    call = Call("all_reduce", dtype, 7, reduce_op, two_step=True, layout=12345)
    assert decode(encode(call)) == call


@pytest.mark.parametrize("op", ["all_reduce", "reduce", "broadcast", "all_gather",
                                "reduce_scatter", "all_to_all", "barrier", "all_to_all_v"])
@pytest.mark.parametrize("numel", [0, 1, 1000, (1 << 40) + 3])
def test_shm_words_round_trip_and_match_the_fast_forms(op, numel):
    if op == "barrier":
        call = Call(op)
    else:
        call = Call(op, torch.float16, numel, "avg" if "reduce" in op else None,
                    3 if op in ("reduce", "broadcast") else -1, two_step=op == "all_reduce")
    a, b = shm_words(call)
    assert from_shm_words(a, b) == call
    if op != "barrier" and numel < 4096:
        t = torch.empty(numel, dtype=torch.float16)
        code = 2 if call.reduce_op else 0  # "avg"
        assert a == shm_word_a(op, t, code, call.two_step)
        assert b == shm_word_b(numel, call.root)


@pytest.mark.parametrize("call", [
    Call("barrier"), Call("all_reduce", torch.float32, 1024, "sum"),
    Call("bucket_all_reduce", torch.bfloat16, (1 << 40) - 1, "min"),
    Call("all_reduce", torch.float16, 0, "max"),
], ids=str)
def test_an_ipc_word_is_odd_past_2_56_and_round_trips(call):
    word = ipc_word(call)
    assert word & 1 and (1 << 56) <= word < (1 << 63)
    assert from_ipc_word(word) == call


def test_describe_names_every_field():
    assert describe(Call("all_reduce", torch.float32, 10, "sum")) == \
        "all_reduce(float32, 10 elements, op sum)"
    assert describe(Call("broadcast", torch.int8, 3, root=1)) == \
        "broadcast(int8, 3 elements, src 1)"
    assert describe(Call("reduce", torch.float32, 5, "premul_sum", 0, two_step=True)) == \
        "reduce(float32, 5 elements, op premul_sum, root 0, two-step)"
    assert describe(Call("gather", torch.float32, root=0, sent=(0, 4), expected=(0, 0))) == \
        "gather(float32, root 0, sending [0, 4], expecting [0, 0])"
    assert describe(Call("barrier")) == "barrier()"


def test_first_difference_names_both_ranks_calls():
    same = encode(Call("all_reduce", torch.float32, 10, "sum"))
    other = encode(Call("all_reduce", torch.float64, 10, "sum"))
    assert first_difference([same, same, same]) is None
    text = first_difference([same, same, other])
    assert text == ("rank 0 called all_reduce(float32, 10 elements, op sum) but rank 2 called "
                    "all_reduce(float64, 10 elements, op sum)")
    assert "rank 7 called" in first_difference([same, other], ranks=[3, 7])


def test_first_difference_names_the_first_flow_that_differs():
    rows = [encode(Call("all_to_all", torch.float32, sent=(1, 2), expected=(1, 2))),
            encode(Call("all_to_all", torch.float32, sent=(2, 2), expected=(2, 2)))]
    assert first_difference(rows) is None
    rows[1] = encode(Call("all_to_all", torch.float32, sent=(3, 2), expected=(2, 2)))
    text = first_difference(rows)
    assert text.startswith("rank 1 sends 3 elements to rank 0, which expects 2 from it")
    assert "rank 0: all_to_all(float32, sending [1, 2]" in text


def test_mismatch_message_names_the_rank_op_and_problem():
    text = mismatch_message(2, "all_reduce", "rank 0 called x but rank 2 called y")
    assert text.startswith("rank 2: all_reduce: collective mismatch: rank 0 called x but rank 2")


@pytest.mark.parametrize("op, name", [(None, None), (ReduceOp.AVG, "avg"),
                                      (BitwiseOp.BXOR, "bxor"), (PremulSum(2.0), "premul_sum")],
                         ids=str)
def test_reduce_name_is_the_name_a_call_holds(op, name):
    assert reduce_name(op) == name
    if name is not None:
        assert name in REDUCE_OPS


def test_a_tensor_call_round_trips_and_reads_as_its_tensor():
    call = tensor_call("reduce", torch.empty(6, dtype=torch.int64), ReduceOp.MAX, 2)
    assert call == Call("reduce", torch.int64, 6, "max", 2)
    assert decode(encode(call)) == call
    assert describe(call) == "reduce(int64, 6 elements, op max, root 2)"
    assert tensor_call("barrier") == Call("barrier")
    assert describe(tensor_call("broadcast", torch.empty(0, dtype=torch.uint8), root=0)) == \
        "broadcast(uint8, 0 elements, src 0)"


def test_a_v_call_round_trips_and_reads_as_its_pieces():
    inputs = [torch.empty(n, dtype=torch.float16) for n in (0, 5, 2)]
    outputs = [torch.empty(n, dtype=torch.float16) for n in (1, 0, 3)]
    call = v_call("scatter", 1, outputs, inputs)
    assert call == Call("scatter", torch.float16, root=1, sent=(0, 5, 2), expected=(1, 0, 3))
    assert decode(encode(call)) == call
    assert describe(call) == "scatter(float16, root 1, sending [0, 5, 2], expecting [1, 0, 3])"


_BASE = Call("reduce", torch.float32, 8, "sum", 0, layout=3)


@pytest.mark.parametrize("field, value, words", [
    ("op", "all_reduce", "all_reduce(float32, 8 elements, op sum, root 0)"),
    ("dtype", torch.bfloat16, "reduce(bfloat16, 8 elements, op sum, root 0)"),
    ("numel", 9, "reduce(float32, 9 elements, op sum, root 0)"),
    ("reduce_op", "min", "reduce(float32, 8 elements, op min, root 0)"),
    ("root", 1, "reduce(float32, 8 elements, op sum, root 1)"),
    ("two_step", True, "reduce(float32, 8 elements, op sum, root 0, two-step)"),
    ("layout", 4, "reduce(float32, 8 elements, op sum, root 0)"),
])
def test_calls_difference_catches_each_field(field, value, words):
    other = Call(**{**{f: getattr(_BASE, f) for f in _BASE.__slots__}, field: value})
    assert calls_difference([_BASE, _BASE]) is None
    want = f"rank 0 called {describe(_BASE)} but rank 1 called {words}"
    assert calls_difference([_BASE, other]) == want
    assert first_difference([encode(_BASE), encode(other)]) == want  # the same through rows


def test_calls_difference_catches_each_flow_and_short_lists():
    ranks = [Call("gather", torch.int8, root=0, sent=(2, 0), expected=(2, 3)),
             Call("gather", torch.int8, root=0, sent=(3, 0), expected=(0, 0))]
    assert calls_difference(ranks) is None
    for q, r in ((0, 1), (1, 0)):
        changed = list(ranks)
        sent = list(changed[q].sent)
        sent[r] += 1
        changed[q] = Call("gather", torch.int8, root=0, sent=tuple(sent),
                          expected=changed[q].expected)
        text = calls_difference(changed, ranks=[4, 6])
        assert text.startswith(f"rank {(4, 6)[q]} sends {sent[r]} elements to rank "
                               f"{(4, 6)[r]}, which expects {changed[r].expected[q]} from it")
    # lists that are not one per rank: compared whole
    short = [Call("all_to_all", torch.int8, sent=(1,), expected=(1,)),
             Call("all_to_all", torch.int8, sent=(2,), expected=(1,))]
    assert calls_difference(short).startswith("rank 0 called all_to_all(int8, sending [1]")


def test_first_difference_ignores_what_a_row_holds_after_its_lists():
    row = encode(Call("all_to_all", torch.int32, sent=(4, 4), expected=(4, 4)))
    assert first_difference([row + [64, 128], row + [0, 1]]) is None
