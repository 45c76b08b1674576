"""torch.distributed backend "aiobrpc": DistributedDataParallel on CPU over aiobrpc's ring.

Importing this module registers the backend; then `dist.init_process_group("aiobrpc")` works
under torchrun unchanged (the ranks meet through the store torch hands the backend). It
implements what DDP uses on CPU (broadcast, allreduce, allgather, barrier) plus
reduce_scatter, each returning a `Work` whose future completes on the group's loop thread.

>>> import aiobrpc.training.torch_backend  # doctest: +SKIP
>>> dist.init_process_group("aiobrpc")  # doctest: +SKIP
>>> model = torch.nn.parallel.DistributedDataParallel(model)  # doctest: +SKIP

Processes that keep another backend can still send DDP's gradients over aiobrpc with the comm
hook: `ddp.register_comm_hook(group_thread, allreduce_hook)`.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from .reduce import ReduceOp
from .thread import GroupThread

BACKEND_NAME = "aiobrpc"

_OPS = {dist.ReduceOp.SUM: ReduceOp.SUM, dist.ReduceOp.AVG: ReduceOp.AVG, dist.ReduceOp.MAX: ReduceOp.MAX,
        dist.ReduceOp.MIN: ReduceOp.MIN}


def _reduce_op(torch_op: Any) -> ReduceOp:
    for key, op in _OPS.items():
        if torch_op == key:
            return op
    raise ValueError(f"the aiobrpc backend supports SUM, AVG, MAX and MIN, not {torch_op}")


class AiobrpcWork(dist.Work):
    """The outcome of one call of the process group: `wait()` blocks for it (raising its
    error), `get_future()` is a torch Future completed from the group's loop thread."""

    def __init__(self, cf: concurrent.futures.Future, result: Any) -> None:
        super().__init__()
        self._cf = cf
        self._future: torch.futures.Future = torch.futures.Future()
        self._result = result
        cf.add_done_callback(self._complete)

    def _complete(self, cf: concurrent.futures.Future) -> None:
        exc = cf.exception()
        if exc is not None:
            self._future.set_exception(exc)
        else:
            self._future.set_result(self._result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._cf.result(timeout.total_seconds() if timeout else None)
        return True

    def is_completed(self) -> bool:
        return self._cf.done()

    def is_success(self) -> bool:
        return self._cf.done() and self._cf.exception() is None

    def exception(self) -> BaseException | None:
        return self._cf.exception() if self._cf.done() else None

    def get_future(self) -> torch.futures.Future:
        return self._future


class AiobrpcProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on an aiobrpc `Group` in a loop thread.

    Args:
        store: torch's store for this group (rendezvous).
        rank, world_size: as torch gives them.
        timeout: seconds (or a timedelta) a collective may take.
        options: more `Group` options (segment_bytes, window, host).
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout: Any = 300.0, **options: Any) -> None:
        super().__init__(rank, world_size)
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        self.threaded = GroupThread(store, rank, world_size, timeout=timeout, **options)
        self.group = self.threaded.group

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"AiobrpcProcessGroup(rank={self.rank()}, world_size={self.size()})"

    def _work(self, result: Any, calls: list[tuple], after: Any = None) -> AiobrpcWork:
        """Start `calls` ((fn, *args) on the group, in this order) as one Work."""
        def run_all():
            import asyncio
            started = [fn(*args) for fn, *args in calls]

            async def finish():
                values = await asyncio.gather(*started)
                if after is not None:
                    after(values)
            return finish()
        return AiobrpcWork(self.threaded.submit(run_all), result)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> AiobrpcWork:
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        views, copy_back = _contiguous(tensors)
        return self._work(tensors, [(self.group.all_reduce, v, op) for v in views], copy_back)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> AiobrpcWork:
        root = opts.rootRank if opts is not None else 0
        views, copy_back = _contiguous(tensors)
        return self._work(tensors, [(self.group.broadcast, v, root) for v in views], copy_back)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> AiobrpcWork:
        world = self.size()
        gathered = [torch.empty((world, *t.shape), dtype=t.dtype) for t in input_tensors]
        inputs = [t.contiguous() for t in input_tensors]

        def scatter_out(_values: Any) -> None:
            for outs, g in zip(output_tensors, gathered):
                for r in range(world):
                    outs[r].copy_(g[r])
        return self._work(output_tensors, [(self.group.all_gather, t, g) for t, g in zip(inputs, gathered)],
                          scatter_out)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> AiobrpcWork:
        if output.is_contiguous() and input.is_contiguous():
            return self._work(output, [(self.group.all_gather, input, output)])
        return self.allgather([list(output.chunk(self.size()))], [input], opts)

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> AiobrpcWork:
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for out, ins in zip(output_tensors, input_tensors):
            if any(t.numel() != out.numel() for t in ins):
                raise ValueError("reduce_scatter over aiobrpc needs input tensors of the output's size")
        flat = [torch.cat([t.reshape(-1) for t in ins]) for ins in input_tensors]

        def store(values: list) -> None:
            for out, part in zip(output_tensors, values):
                out.reshape(-1).copy_(_from_numpy(part, out.dtype))
        return self._work(output_tensors, [(self.group.reduce_scatter, f, op) for f in flat], store)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> AiobrpcWork:
        return self.reduce_scatter([output], [list(input.chunk(self.size()))], opts)

    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts: Any = None) -> AiobrpcWork:
        return self._work([], [(self.group.barrier,)])

    def shutdown(self) -> None:
        self.threaded.close()

    def __del__(self) -> None:
        threaded = getattr(self, "threaded", None)
        if threaded is not None:
            threaded.close()


def _contiguous(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """Contiguous stand-ins for `tensors`, and what copies results back into the others."""
    views = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    pairs = [(t, v) for t, v in zip(tensors, views) if v is not t]
    if not pairs:
        return views, None

    def copy_back(_values: Any) -> None:
        for t, v in pairs:
            t.copy_(v)
    return views, copy_back


def _from_numpy(part: Any, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(part)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def listen_host() -> str:
    """The address this rank listens on: $AIOBRPC_HOST, else the local address that routes to
    $MASTER_ADDR (127.0.0.1 when that is this machine or unset)."""
    host = os.environ.get("AIOBRPC_HOST")
    if host:
        return host
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master), 9))  # UDP: picks a route, sends nothing
            local = s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    return "127.0.0.1" if local.startswith("127.") else local


def _create(store: Any, rank: int, world_size: int, timeout: Any) -> AiobrpcProcessGroup:
    return AiobrpcProcessGroup(store, rank, world_size, timeout, host=listen_host())


def allreduce_hook(state, bucket):  # no annotations: DDP compares them with its own types
    """DDP comm hook: average the gradient bucket (a `dist.GradBucket`) over `state` (a
    GroupThread spanning the same ranks), whatever backend the process group has; returns a
    `torch.futures.Future` of the averaged bucket tensor. Register it with
    `ddp.register_comm_hook(group_thread, allreduce_hook)`."""
    buffer = bucket.buffer()
    fut: torch.futures.Future = torch.futures.Future()
    cf = state.submit(state.group.all_reduce, buffer, ReduceOp.AVG)

    def done(cf: concurrent.futures.Future) -> None:
        exc = cf.exception()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(buffer)
    cf.add_done_callback(done)
    return fut


def register() -> None:
    """Register the "aiobrpc" backend with torch.distributed (done when this module is imported)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])


register()
