"""The worker side of the parameter server, for an asyncio training loop.

A `PsWorker` holds one channel per server and splits each init, push and pull by the key's
shard (sharding.py); the calls to different servers run at once. It numbers its steps: a
`pull` asks for the weights of its current step, a `push` sends that step's gradients and
moves to the next.

A server's replies carry its generation. When one changes (the server restarted and lost its
clocks, perhaps its keys), the call raises `ServerRestarted` (and `on_restart` is called);
`resume()` then re-creates on that server the keys it lacks, from the last weights this worker
pulled (or those given), at this worker's step, and training goes on from the next `pull`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ... import tensor
from ...client.channel import Channel
from ...controller import Controller
from ...options import ChannelOptions
from ...stub import Stub
from ..._proto import ps_pb2
from .server import SERVICE
from .sharding import shard_of

__all__ = ["PsWorker", "ServerRestarted"]


class ServerRestarted(RuntimeError):
    """A parameter server answered with a generation other than the one this worker knew.

    Attributes: `shard` (its index in the worker's server list), `address`, `old_generation`,
    `new_generation`. Call `PsWorker.resume()`, then `pull()`.
    """

    def __init__(self, shard: int, address: str, old_generation: int, new_generation: int) -> None:
        super().__init__(f"parameter server {shard} ({address}) restarted: generation {old_generation:#x} "
                         f"is now {new_generation:#x}; call resume() and pull() to go on")
        self.shard = shard
        self.address = address
        self.old_generation = old_generation
        self.new_generation = new_generation


def _check_rows(rows: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    out = {}
    for key, ids in (rows or {}).items():
        a = np.asarray(ids)
        if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
            raise ValueError(f"row ids of {key!r} must be integers of one dimension, got {a.dtype} {list(a.shape)}")
        out[key] = np.ascontiguousarray(a, np.int64)
    return out


class PsWorker:
    """Worker `worker` of a parameter server made of `servers` (addresses "host:port", the
    same list, in the same order, on every worker).

    Args:
        servers: One address per shard.
        worker: This worker's number, 0 .. num_workers - 1 (the servers' num_workers).
        timeout_s: The deadline of each call, a pull's wait for other workers included.
        max_retry: Retries of a call after a connection failure (pushes carry their step,
            so a retried push is applied once).
        on_restart: Called with the `ServerRestarted` error before it is raised.
        max_body_size: The largest reply accepted from one server (a pull's weights), bytes.

    See `ParameterServer` for an example.
    """

    def __init__(self, servers: Sequence[str], worker: int = 0, *, timeout_s: float = 30.0,
                 max_retry: int = 2, on_restart: Callable[[ServerRestarted], None] | None = None,
                 max_body_size: int = 1 << 28) -> None:
        if isinstance(servers, str) or not servers or not all(isinstance(s, str) for s in servers):
            raise ValueError(f"servers must be a non-empty list of 'host:port' addresses, got {servers!r}")
        if not isinstance(worker, int) or isinstance(worker, bool) or worker < 0:
            raise ValueError(f"worker must be an int >= 0, got {worker!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        options = ChannelOptions(timeout_ms=max(1, round(timeout_s * 1000)), max_retry=max_retry,
                                 deliver_timeout_ms=True, max_body_size=max_body_size)
        self.servers = list(servers)
        self.worker = worker
        self.step = 0
        self.on_restart = on_restart
        self._channels = [Channel(address, options) for address in self.servers]
        self._stubs = [Stub(ch, SERVICE) for ch in self._channels]
        self._generations = [0] * len(self.servers)  # 0: not met yet
        self._restarted: set[int] = set()
        self._keys: list[str] = []  # from init, the default of pull
        self._latest: dict[str, Any] = {}  # the last pulled weights, for resume

    def shard_of(self, key: str) -> int:
        """The index in `servers` of the server holding `key`."""
        return shard_of(key, len(self.servers))

    def _split(self, names) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for name in names:
            if not isinstance(name, str) or not name:
                raise TypeError(f"keys must be non-empty str, got {name!r}")
            if len(self.servers) == 1:
                out.setdefault(0, []).append(name)
            else:
                out.setdefault(self.shard_of(name), []).append(name)
        return out

    def _seen(self, shard: int, generation: int) -> None:
        known = self._generations[shard]
        if known == 0:
            self._generations[shard] = generation
        elif generation != known:
            self._restarted.add(shard)
            err = ServerRestarted(shard, self.servers[shard], known, generation)
            if self.on_restart is not None:
                self.on_restart(err)
            raise err

    @staticmethod
    async def _all(calls) -> list:
        if len(calls) == 1:
            return [await calls[0]]  # one server: no task and no gather per call
        # Every call ends (each has its deadline); the first error is raised after all did,
        # a restart before any other.
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise next((e for e in errors if isinstance(e, ServerRestarted)), errors[0])
        return results

    # -- calls -----------------------------------------------------------------------------

    async def init(self, params: Mapping[str, Any], *, step: int | None = None) -> list[str]:
        """Create `params` (name -> float32/float64 array or tensor) on their servers unless
        they exist there (the first worker's init wins: pull to read what the servers hold).
        Returns the keys this call created. `step`: start at this step (default: the worker's).
        """
        if step is not None:
            if not isinstance(step, int) or step < 0:
                raise ValueError(f"step must be an int >= 0, got {step!r}")
            self.step = step
        created: list[str] = []

        async def one(shard: int, keys: list[str]) -> None:
            cntl = Controller()
            meta = tensor.set_request_tensors(cntl, {k: params[k] for k in keys}, copy=True)
            req = ps_pb2.InitRequest(generation=self._generations[shard], values=meta, step=self.step)
            resp = await self._stubs[shard].Init(req, cntl)
            self._seen(shard, resp.generation)
            created.extend(resp.created)

        await self._all([one(s, ks) for s, ks in self._split(params).items()])
        self._keys.extend(k for k in params if k not in self._keys)
        return created

    async def push(self, grads: Mapping[str, Any], *, rows: Mapping[str, Any] | None = None) -> None:
        """Send this step's gradients (name -> array or tensor, of the key's dtype), then move
        to the next step. For a key in `rows` (name -> row ids), the gradient holds those rows
        of the key only. In sync and bounded modes push every key you pull, every step."""
        ids = _check_rows(rows)
        for key in ids:
            if key not in grads:
                raise ValueError(f"rows given for {key!r} but no gradient")
        step = self.step

        async def one(shard: int, keys: list[str]) -> None:
            cntl = Controller()
            meta, buffers = tensor.pack({k: grads[k] for k in keys})
            req = ps_pb2.PushRequest(generation=self._generations[shard], worker=self.worker, step=step,
                                     grads=meta)
            shard_ids = {k: ids[k] for k in keys if k in ids}
            if shard_ids:
                id_meta, id_buffers = tensor.pack(shard_ids)
                end = sum(b.nbytes for b in buffers)  # the ids follow the gradients in the attachment
                for info in id_meta.tensors:
                    info.offset += end
                req.row_ids.CopyFrom(id_meta)
                buffers += id_buffers
            cntl.request_attachment = buffers
            resp = await self._stubs[shard].Push(req, cntl)
            self._seen(shard, resp.generation)

        await self._all([one(s, ks) for s, ks in self._split(grads).items()])
        self.step = step + 1

    async def pull(self, keys: Sequence[str] | None = None, *, rows: Mapping[str, Any] | None = None,
                   out: Mapping[str, Any] | None = None, torch: bool = False) -> dict[str, Any]:
        """The weights of this step: name -> array for `keys` (default: those of `init`), and
        for each key of `rows` (name -> row ids) those rows. Arrays are views of the received
        bytes (torch tensors with `torch=True`), rows under their key's name; a key in `out` (name -> array or tensor of
        the key's dtype and size) is copied into it instead, which is returned in its place.
        In sync and bounded modes the servers answer once the other workers have caught up."""
        keys = list(self._keys if keys is None else keys)
        ids = _check_rows(rows)
        out = out or {}
        if len(set(keys)) != len(keys):
            raise ValueError(f"{next(k for k in keys if keys.count(k) > 1)!r} is asked twice")
        both = [k for k in ids if k in keys]
        if both:
            raise ValueError(f"{both[0]!r} is asked whole and by rows: pull it one way per call")
        extra = [k for k in out if k not in keys]
        if extra:
            raise ValueError(f"out has {extra[0]!r}, which is not pulled whole (keys: {keys})")
        result: dict[str, Any] = {}
        row_result: dict[str, Any] = {}
        step = self.step
        by_shard = self._split(keys)
        for s, ks in self._split(ids).items():
            by_shard.setdefault(s, [])

        async def one(shard: int, whole: list[str]) -> None:
            cntl = Controller()
            shard_ids = {k: ids[k] for k in ids if len(self.servers) == 1 or self.shard_of(k) == shard}
            if len(whole) == 1 and not shard_ids and out.get(whole[0]) is not None:
                # One whole key into the caller's array: received there by the kernel, no copy
                # (get_response_tensors sees it and copies nothing).
                _, raw = tensor.raw_array(out[whole[0]], what=f"out[{whole[0]!r}]")
                cntl.response_attachment_into = memoryview(raw).cast("B")
            meta = tensor.set_request_tensors(cntl, shard_ids)
            req = ps_pb2.PullRequest(generation=self._generations[shard], worker=self.worker, step=step,
                                     keys=whole, row_ids=meta)
            resp = await self._stubs[shard].Pull(req, cntl)
            self._seen(shard, resp.generation)
            n = len(whole)
            if len(resp.values.tensors) != n + len(shard_ids):
                raise ValueError(f"server {shard} answered {len(resp.values.tensors)} tensors for "
                                 f"{n + len(shard_ids)} asked")
            dest = [out.get(k) for k in whole] + [None] * len(shard_ids) if out else None
            got = tensor.get_response_tensors(cntl, resp.values, dest, torch=torch)
            result.update(zip(whole, got[:n]))
            row_result.update(zip(shard_ids, got[n:]))

        await self._all([one(s, ks) for s, ks in by_shard.items()])
        ordered = {k: result[k] for k in keys}
        self._latest.update(ordered)
        ordered.update((k, row_result[k]) for k in ids)
        return ordered

    async def resume(self, params: Mapping[str, Any] | None = None) -> list[str]:
        """After `ServerRestarted`: accept the new generations, and re-create on the restarted
        servers the keys they lack from `params` (default: the weights of the last pull) at
        this worker's step. Returns the keys re-created (another worker may have done it)."""
        restarted, self._restarted = self._restarted, set()
        for shard in restarted:
            self._generations[shard] = 0
        source = self._latest if params is None else params
        keys = [k for k in self._keys if self.shard_of(k) in restarted]
        missing = [k for k in keys if k not in source]
        if missing:
            raise ValueError(f"no values to resume {missing} from: pass them in params")
        if not keys:
            # Meet the new generation anyway, so the next calls carry it.
            await self._all([self._probe(s) for s in restarted])
            return []
        return await self.init({k: source[k] for k in keys})

    async def _probe(self, shard: int) -> None:
        resp = await self._stubs[shard].Init(ps_pb2.InitRequest(), Controller())
        self._seen(shard, resp.generation)

    async def close(self) -> None:
        """Close the channels (calls in flight end with an error)."""
        await asyncio.gather(*(ch.close() for ch in self._channels))

    async def __aenter__(self) -> PsWorker:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
