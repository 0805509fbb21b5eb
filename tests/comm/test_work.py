"""Work: lazy futures, waits with timeouts, completion from another thread."""

import threading

import pytest
import torch

from fastcomm.comm.errors import CommTimeoutError, FastcommError
from fastcomm.comm.work import OrderedExecutor, Task, Work, completed_work


def test_completed_work_is_done_and_its_future_resolves_on_request():
    out = torch.ones(3)
    work = completed_work("all_reduce", 0, out)
    assert work.is_completed() and work.is_success() and work.wait() is True
    assert work._future is None  # nothing built until asked for
    future = work.get_future()
    assert future.done() and future.value() is out
    assert work.get_future() is future


@pytest.mark.parametrize("future_first", [True, False])
def test_future_resolves_once_whichever_comes_first(future_first):
    out = torch.zeros(2)
    work = Work("broadcast", 1, out)
    assert not work.is_completed()
    if future_first:
        future = work.get_future()
        assert not future.done()
        work._complete()
    else:
        work._complete()
        future = work.get_future()
    assert future.value() is out
    work._complete()  # a second completion is ignored
    work._fail(RuntimeError("late"))
    assert work.is_success() and work.wait()


@pytest.mark.parametrize("future_first", [True, False])
def test_failure_reaches_wait_and_the_future(future_first):
    work = Work("all_gather", 2, None)
    error = FastcommError("rank 2: all_gather failed")
    future = work.get_future() if future_first else None
    work._fail(error)
    future = future or work.get_future()
    with pytest.raises(FastcommError, match="rank 2: all_gather failed"):
        work.wait()
    with pytest.raises(RuntimeError, match="all_gather failed"):
        future.wait()
    assert work.is_completed() and not work.is_success() and work.exception() is error


def test_wait_times_out_naming_rank_and_op():
    work = Work("reduce_scatter", 3, None)
    with pytest.raises(CommTimeoutError, match=r"rank 3: reduce_scatter did not complete within"):
        work.wait(0.05)
    with pytest.raises(CommTimeoutError):
        work.wait(-1.0)  # a negative timeout does not block
    work._complete()
    assert work.wait(0.0)


def test_every_waiter_wakes_when_another_thread_completes():
    work = Work("all_reduce", 0, torch.ones(1))
    woke = []

    def waiter():
        woke.append(work.wait(10.0))

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for t in threads:
        t.start()
    work._complete()
    for t in threads:
        t.join(10.0)
    assert woke == [True] * 4


def test_lazy_future_races_with_completion_resolve_exactly_once():
    executor = OrderedExecutor("fastcomm-test-work-executor", 0, lambda task, start: task.run())
    try:
        for i in range(200):
            task = Task("all_reduce", torch.full((1,), float(i)), lambda: None)
            work = executor.run(task, async_op=True)
            future = work.get_future()  # may come before or after the executor completes it
            assert future.wait().item() == i
            assert work.wait(10.0)
    finally:
        assert executor.close(10.0)


def _recording_task(ran_on: list, done: threading.Event | None = None) -> Task:
    def run() -> None:
        ran_on.append(threading.current_thread().name)
        if done is not None:
            done.set()

    return Task("all_reduce", None, run)


def test_async_task_waited_on_at_once_runs_on_the_caller():
    # the thread is not woken for it (a wake costs a switch each way): wait() runs it here
    executor = OrderedExecutor("fastcomm-test-executor", 0, lambda task, start: task.run())
    ran_on: list[str] = []
    try:
        executor.run(_recording_task(ran_on), async_op=True).wait()  # starts the thread
        for _ in range(20):
            executor.run(_recording_task(ran_on), async_op=True).wait()
        here = threading.current_thread().name
        # the thread polls every POLL_S and may take one between run() and wait()
        assert ran_on[1:].count(here) >= 10, ran_on
    finally:
        assert executor.close(10.0)


@pytest.mark.parametrize("how", ["poll", "is_completed", "get_future", "wait_timeout"])
def test_async_task_nobody_helps_runs_on_the_thread(how):
    executor = OrderedExecutor("fastcomm-test-executor", 0, lambda task, start: task.run())
    ran_on: list[str] = []
    done = threading.Event()
    try:
        executor.run(_recording_task(ran_on), async_op=True).wait()
        work = executor.run(_recording_task(ran_on, done), async_op=True)
        if how == "poll":  # untouched: the thread's next poll takes it
            assert done.wait(10.0)
        elif how == "is_completed":
            for _ in range(10_000):
                if work.is_completed():
                    break
                done.wait(0.001)
            assert work.is_completed()
        elif how == "get_future":
            assert work.get_future().wait() is None
        else:
            assert work.wait(timeout=10.0)
        assert work.wait(10.0) and ran_on[-1] == "fastcomm-test-executor"
    finally:
        assert executor.close(10.0)


def test_parked_thread_is_woken_by_the_next_task(monkeypatch):
    from fastcomm.comm import work as work_module

    monkeypatch.setattr(work_module, "PARK_S", 0.02)
    executor = OrderedExecutor("fastcomm-test-executor", 0, lambda task, start: task.run())
    ran_on: list[str] = []
    done = threading.Event()
    try:
        executor.run(_recording_task(ran_on), async_op=True).wait()
        for _ in range(1000):  # idle past PARK_S: the thread stops polling
            if executor._parked:
                break
            done.wait(0.005)
        assert executor._parked
        executor.run(_recording_task(ran_on, done), async_op=True)
        assert done.wait(10.0) and ran_on[-1] == "fastcomm-test-executor"
    finally:
        assert executor.close(10.0)
