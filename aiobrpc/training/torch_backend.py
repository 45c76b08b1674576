"""torch.distributed backend "aiobrpc": DDP, FSDP2, pipelines and meshes on CPU over aiobrpc.

Importing this module registers the backend; then `dist.init_process_group("aiobrpc")` works
under torchrun unchanged (the ranks meet through the store torch hands the backend). Every
operation returns a `Work` whose future completes on the group's loop thread:
- ring collectives: allreduce (SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR, BXOR), broadcast,
  allgather, reduce_scatter, their `*_single` / `_base` / coalesced forms, reduce, barrier;
- point-to-point: send, recv, recv_anysource (so isend/irecv and batch_isend_irecv), any dtype;
- made of messages: gather, scatter, alltoall, all_to_all_single with uneven splits; the
  object collectives run through these;
- groups: the creator takes torch's extended API, so each group knows its name (`group_name`),
  which `new_group`, `new_subgroups`, `DeviceMesh` and FSDP2 need.
docs/training.md has the table of what it supports against gloo.

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

from .group import _tag
from .reduce import ReduceOp
from .thread import GroupThread

BACKEND_NAME = "aiobrpc"

_OPS = {dist.ReduceOp.SUM: ReduceOp.SUM, dist.ReduceOp.AVG: ReduceOp.AVG, dist.ReduceOp.MAX: ReduceOp.MAX,
        dist.ReduceOp.MIN: ReduceOp.MIN, dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT, dist.ReduceOp.BAND: ReduceOp.BAND,
        dist.ReduceOp.BOR: ReduceOp.BOR, dist.ReduceOp.BXOR: ReduceOp.BXOR}


def _reduce_op(torch_op: Any, tensors: list[torch.Tensor] = ()) -> ReduceOp:
    for key, op in _OPS.items():
        if torch_op == key:
            for t in tensors:
                if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and (t.is_floating_point() or t.is_complex()):
                    raise ValueError(f"ReduceOp.{op.name} needs integer or bool tensors, got {t.dtype}")
                if op is ReduceOp.AVG and not t.is_floating_point():
                    raise ValueError(f"ReduceOp.AVG needs floating-point tensors, got {t.dtype}")
            return op
    raise ValueError(f"the aiobrpc backend supports SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR and BXOR, not {torch_op}")


class AiobrpcWork(dist.Work):
    """The outcome of one call of the process group: `wait()` blocks for it (raising its
    error), `get_future()` is a torch Future completed from the group's loop thread."""

    def __init__(self, cf: concurrent.futures.Future, result: Any) -> None:
        super().__init__()
        self._cf = cf
        self._future: torch.futures.Future | None = None  # made when asked for: most callers only wait()
        self._result = result

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
        if self._future is None:
            self._future = torch.futures.Future()
            self._cf.add_done_callback(self._complete)  # at once when the work is already done
        return self._future

    def _source_rank(self) -> int:
        """The group rank a recv got its message from (recv from any source)."""
        values = self._cf.result()  # what the group's calls gave: a recv gives its source
        if not isinstance(values, list):
            return int(values)
        return int(values[-1]) if values else -1

    source_rank = _source_rank


class _BackendInfo:
    """What torch asks of a group's per-device backend (`pg._get_backend(device)`): FSDP2 asks
    whether it allocates tensors itself (no)."""

    supports_coalescing = False
    supports_splitting = False

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def name(self) -> str:
        return BACKEND_NAME


class AiobrpcProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose operations run on an aiobrpc `Group` in a loop thread.

    Args:
        store: torch's store for this group (rendezvous).
        rank, world_size: as torch gives them.
        timeout: seconds (or a timedelta) an operation may take.
        group_name: torch's name of the group (DeviceMesh and the functional collectives find
            groups by it); torch sets it when it makes the group.
        options: more `Group` options (segment_bytes, window, host, p2p_buffer_bytes ...).
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout: Any = 300.0, group_name: str = "",
                 **options: Any) -> None:
        super().__init__(rank, world_size)
        self._rank, self._size = rank, world_size  # torch's rank() and size() cost a binding call each
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        self._group_name = group_name
        self._group_desc = ""
        self._coalesced: list[AiobrpcWork] | None = None
        self.threaded = GroupThread(store, rank, world_size, timeout=timeout, **options)
        self.group = self.threaded.group

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def _get_backend(self, device: Any) -> _BackendInfo:
        if torch.device(device).type != "cpu":
            raise RuntimeError(f"the aiobrpc backend runs on cpu, not {device}")
        return _BackendInfo()

    def __repr__(self) -> str:
        return f"AiobrpcProcessGroup(rank={self.rank()}, world_size={self.size()}, name={self._group_name!r})"

    def _work(self, result: Any, calls: list[tuple], after: Any = None) -> AiobrpcWork:
        """Start `calls` ((fn, *args) on the group, in this order) as one Work; `after(values)`
        runs on the loop thread with what they gave."""
        if len(calls) == 1 and after is None:  # one call (send, recv ...): its own future, no gather
            work = AiobrpcWork(self.threaded.submit(*calls[0]), result)
            if self._coalesced is not None:
                self._coalesced.append(work)
            return work

        def run_all():
            import asyncio
            started = [fn(*args) for fn, *args in calls]

            async def finish():
                values = await asyncio.gather(*started)
                if after is not None:
                    after(values)
                return values
            return finish()
        work = AiobrpcWork(self.threaded.submit(run_all), result)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    # -- ring collectives ----------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> AiobrpcWork:
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, tensors)
        views, copy_back = _contiguous(tensors)
        return self._work(tensors, [(self.group.all_reduce, v, op) for v in views], copy_back)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> AiobrpcWork:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> AiobrpcWork:
        root = opts.rootRank if opts is not None else 0
        views, copy_back = _contiguous(tensors)
        return self._work(tensors, [(self.group.broadcast, v, root) for v in views], copy_back)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> AiobrpcWork:
        """All-reduce of a copy; the root keeps the result (gloo leaves the others' tensors
        unspecified, here they are unchanged)."""
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, tensors)
        root = opts.rootRank if opts is not None else 0
        self._check_rank(root, "root")
        copies = [t.contiguous().clone() for t in tensors]

        def keep(_values: Any) -> None:
            if self.rank() == root:
                for t, c in zip(tensors, copies):
                    t.copy_(c)
        return self._work(tensors, [(self.group.all_reduce, c, op) for c in copies], keep)

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

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                            opts: Any = None) -> AiobrpcWork:
        return self.allgather(output_lists, input_tensors, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> AiobrpcWork:
        if output.numel() != input.numel() * self.size() or output.dtype != input.dtype:
            raise ValueError(f"all_gather_into_tensor needs an output of {self.size()} x {input.numel()} "
                             f"{input.dtype}, got {output.numel()} {output.dtype}")
        if output.is_contiguous() and input.is_contiguous():
            return self._work(output, [(self.group.all_gather, input, output)])
        return self.allgather([list(output.reshape(-1).chunk(self.size()))], [input.reshape(-1)], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> AiobrpcWork:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._all_of(outputs, works)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> AiobrpcWork:
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, output_tensors)
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != self.size() or any(t.numel() != out.numel() for t in ins):
                raise ValueError(f"reduce_scatter needs {self.size()} input tensors of the output's size")
        flat = [torch.cat([t.reshape(-1) for t in ins]) for ins in input_tensors]

        def store(values: list) -> None:
            for out, part in zip(output_tensors, values):
                out.reshape(-1).copy_(_from_numpy(part, out.dtype)) if out.is_contiguous() else \
                    out.copy_(_from_numpy(part, out.dtype).reshape(out.shape))
        return self._work(output_tensors, [(self.group.reduce_scatter, f, op) for f in flat], store)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> AiobrpcWork:
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"reduce_scatter_tensor needs an input of {self.size()} x {output.numel()} "
                             f"elements, got {input.numel()}")
        return self.reduce_scatter([output], [list(input.reshape(-1).chunk(self.size()))], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> AiobrpcWork:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._all_of(outputs, works)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts: Any = None) -> AiobrpcWork:
        return self._work([], [(self.group.barrier,)])

    # -- point-to-point ------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> AiobrpcWork:
        self._check_rank(dst, "dst")
        views = [t.contiguous() for t in tensors]
        messages = self.group.messages
        if messages is not None and len(views) == 1:  # on lanes: written from this thread, no hand-over
            self._check_peer(dst, "dst")
            return self._direct(tensors, messages.send(views[0], dst, _tag(tag)))
        return self._work(tensors, [(self.group.send, v, dst, tag) for v in views])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> AiobrpcWork:
        self._check_rank(src, "src")
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> AiobrpcWork:
        return self._recv(tensors, None, tag)

    def _recv(self, tensors: list[torch.Tensor], src: int | None, tag: int) -> AiobrpcWork:
        messages = self.group.messages
        if messages is not None and len(tensors) == 1 and tensors[0].is_contiguous():
            # on lanes: the lane's reader completes the Work, no hand-over to the loop
            if src is not None:
                self._check_peer(src, "src")
            return self._direct(tensors, messages.recv(tensors[0], src, _tag(tag)))
        views, copy_back = _contiguous(tensors)
        return self._work(tensors, [(self.group.recv, v, src, tag) for v in views], copy_back)

    def _direct(self, result: Any, cf: concurrent.futures.Future) -> AiobrpcWork:
        work = AiobrpcWork(cf, result)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _check_peer(self, rank: int, name: str) -> None:
        if rank == self._rank:
            raise ValueError(f"{name} must be another rank of the group, not this one ({rank})")

    # -- collectives made of messages ----------------------------------------------------------
    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> AiobrpcWork:
        root = opts.rootRank if opts is not None else 0
        self._check_rank(root, "root")
        (tensor,) = input_tensors
        outs = None
        copy_back = None
        if self.rank() == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != self.size():
                raise ValueError(f"gather on its root needs a list of {self.size()} tensors")
            _same(output_tensors[0], tensor, "gather_list")
            outs, copy_back = _contiguous(output_tensors[0])
        return self._work(output_tensors, [(self.group.gather, tensor.contiguous(), outs, root)], copy_back)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> AiobrpcWork:
        root = opts.rootRank if opts is not None else 0
        self._check_rank(root, "root")
        (out,) = output_tensors
        ins = None
        if self.rank() == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != self.size():
                raise ValueError(f"scatter on its root needs a list of {self.size()} tensors")
            _same(input_tensors[0], out, "scatter_list")
            ins = [t.contiguous() for t in input_tensors[0]]
        (view,), copy_back = _contiguous([out])
        return self._work(output_tensors, [(self.group.scatter, view, ins, root)], copy_back)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> AiobrpcWork:
        world = self.size()
        if len(output_tensors) != world or len(input_tensors) != world:
            raise ValueError(f"all_to_all needs {world} input and {world} output tensors, got "
                             f"{len(input_tensors)} and {len(output_tensors)}")
        dtypes = {t.dtype for t in (*output_tensors, *input_tensors)}
        if len(dtypes) > 1:
            raise ValueError(f"all_to_all needs tensors of one dtype, got {sorted(map(str, dtypes))}")
        outs, copy_back = _contiguous(output_tensors)
        ins = [t.contiguous() for t in input_tensors]
        return self._work(output_tensors, [(self.group.all_to_all, outs, ins)], copy_back)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> AiobrpcWork:
        if output.dtype != input.dtype:
            raise ValueError(f"all_to_all_single needs one dtype, got {input.dtype} in and {output.dtype} out")
        world = self.size()
        ins = _split(input, input_split_sizes, world, "input")
        out_view = output if output.is_contiguous() else output.contiguous()
        outs = _split(out_view, output_split_sizes, world, "output")
        def copy_back(_values: Any) -> None:
            output.copy_(out_view)
        return self._work(output, [(self.group.all_to_all, outs, ins)],
                          copy_back if out_view is not output else None)

    alltoall_base = all_to_all_single

    # -- coalescing (torch's _coalescing_manager with a device) --------------------------------
    def _start_coalescing(self, device: Any = None) -> None:
        self._coalesced = []

    def _end_coalescing(self, device: Any = None) -> AiobrpcWork:
        works, self._coalesced = self._coalesced or [], None
        return self._all_of([], works)

    def _all_of(self, result: Any, works: list[AiobrpcWork]) -> AiobrpcWork:
        """One Work done when all of `works` are (the first error wins)."""
        combined: concurrent.futures.Future = concurrent.futures.Future()
        left = [len(works)]

        def one(cf: concurrent.futures.Future) -> None:
            left[0] -= 1
            if cf.exception() is not None and not combined.done():
                combined.set_exception(cf.exception())
            elif left[0] == 0 and not combined.done():
                combined.set_result(None)
        if not works:
            combined.set_result(None)
        for w in works:
            w._cf.add_done_callback(one)
        return AiobrpcWork(combined, result)

    def _check_rank(self, rank: Any, name: str) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self._size:
            raise ValueError(f"{name} must be a rank of the group, 0..{self._size - 1}, got {rank!r}")

    def shutdown(self) -> None:
        self.threaded.close()

    def __del__(self) -> None:
        threaded = getattr(self, "threaded", None)
        if threaded is not None:
            threaded.close()


def _same(tensors: list[torch.Tensor], like: torch.Tensor, what: str) -> None:
    for t in tensors:
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise ValueError(f"{what} tensors must be {like.numel()} {like.dtype} like the tensor, "
                             f"got {t.numel()} {t.dtype}")


def _split(t: torch.Tensor, sizes: list[int], world: int, what: str) -> list[torch.Tensor]:
    """`t` cut along dim 0 into `world` contiguous views: `sizes` rows each (equal when empty)."""
    rows = t.shape[0] if t.dim() else 1
    if not sizes:
        if rows % world:
            raise ValueError(f"all_to_all_single: the {what} has {rows} rows, which {world} ranks cannot split "
                             f"evenly; pass {what}_split_sizes")
        sizes = [rows // world] * world
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"all_to_all_single: {what}_split_sizes {sizes} must be {world} sizes >= 0 adding up "
                         f"to the {what}'s {rows} rows")
    return list((t if t.dim() else t.reshape(1)).split(sizes))


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


def _create(common: Any, backend_options: Any = None) -> AiobrpcProcessGroup:
    """torch's extended creator API: `common` is a `_DistributedBackendOptions` (store, group
    rank and size, timeout, the group's name)."""
    return AiobrpcProcessGroup(common.store, common.group_rank, common.group_size, common.timeout,
                               group_name=str(common.group_id), host=listen_host(), prefix=store_prefix(),
                               lanes=lanes_wanted())


def lanes_wanted() -> bool:
    """$AIOBRPC_LANES: 1 (the default) carries the collectives on lanes, 0 on calls."""
    value = os.environ.get("AIOBRPC_LANES", "1")
    if value not in ("0", "1"):
        raise ValueError(f"AIOBRPC_LANES must be 0 or 1, got {value!r}")
    return value == "1"


def store_prefix() -> str:
    """Where the group's rendezvous keys go in torch's store: one place per torchrun attempt.
    torchrun (2.13, --standalone) hands the workers of a restart the same store as the attempt
    before, keys and all: without this, a restarted rank reads the dead attempt's addresses
    (gloo's restart fails that way: connectFullMesh is refused)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"aiobrpc/attempt_{attempt}" if attempt and attempt.isdigit() else "aiobrpc"


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
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])


register()
