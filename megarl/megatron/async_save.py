"""A rank's asynchronous checkpoint writes, on megatron-core's queue (dist_checkpointing/strategies/async_utils.py
`AsyncCallsQueue` with `TemporalAsyncCaller`): scheduling a request forks a writer process that holds a copy-on-write
image of the rank's state at that moment (on a GPU, the tensors were first copied to host memory by the request's
`preload_fn`), so training may change the weights while it writes. Finalizing runs the request's finalize functions
(the global metadata, written by rank 0) and, like every check of the queue, is collective over the role's world.

The writers report their results through a pipe that a thread of the rank drains (`dist_ckpt._ResultsPipe`, set
before the first asynchronous save: megatron's own is a spawn-context server process per rank).
"""

from collections.abc import Callable
from typing import Any

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

from megarl.megatron.dist_ckpt import SavePlans

Write = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _write_in_turn(writes: list[Write]) -> None:
    for fn, args, kwargs in writes:
        fn(*args, **kwargs)


def in_turn(requests: list[AsyncRequest]) -> AsyncRequest:
    """One request whose writer process writes each of `requests` in turn. The writers of separate requests would
    report to the one results queue in whatever order they finish, and each request's finalize functions take the
    next result from it: in one process the results arrive in the order the finalize functions read them. Each
    request's `preload_fn` runs now, as megatron's caller runs a request's own just before it forks."""
    writes: list[Write] = []
    for request in requests:
        if request.async_fn is None:  # nothing of this request to write on this rank; its finalize still runs
            continue
        args = list(request.async_fn_args)
        if request.preload_fn is not None:
            args[1] = request.preload_fn()  # the write buckets' argument (TemporalAsyncCaller.schedule_async_call)
        writes.append((request.async_fn, tuple(args), request.async_fn_kwargs))
    return AsyncRequest(_write_in_turn, (writes,), [fn for request in requests for fn in request.finalize_fns])


class AsyncWrites:
    """The asynchronous saves of one rank that are not finalized yet."""

    def __init__(self) -> None:
        self.queue = AsyncCallsQueue()
        self.plans = SavePlans()

    def schedule(self, requests: list[AsyncRequest]) -> None:
        """Start one writer process for the requests (`in_turn`). Collective (megatron numbers the calls on every rank
        alike)."""
        self.queue.schedule_async_request(in_turn(requests))

    def finish(self, blocking: bool) -> bool:
        """Finalize the saves whose writers finished on every rank (all of them when `blocking`); whether none is
        left. Raises torch's `CheckpointException` on every rank when a writer failed. Collective."""
        self.queue.maybe_finalize_async_calls(blocking=blocking)
        return self.queue.get_num_unfinalized_calls() == 0
