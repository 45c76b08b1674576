"""PartitionChannel: a ParallelChannel over the partitions of a sharded service, whose
servers come from one naming service with their partition in their tags (brpc's
PartitionChannel, docs/en/combo_channel.md).

>>> PartitionParser().parse("1/3")
Partition(index=1, num_partition_kinds=3)
>>> PartitionParser().parse("shard-1") is None
True
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from ...controller import Controller
from ...errors import ENODATA, RpcError
from ...options import ChannelOptions
from ..channel import Channel
from ..lb import create_load_balancer
from ..naming import ServerNode
from .controllers import begin, fail
from .feed import ServerFeed
from .follow import NamingFollower
from .members import MAX_SUB_CHANNELS, close_all
from .parallel import ParallelChannel, ParallelChannelOptions

log = logging.getLogger(__name__)

_SLASH_TAG = re.compile(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*")


@dataclass(frozen=True)
class Partition:
    """Where a server belongs: partition `index` (0-based) of `num_partition_kinds`."""

    index: int
    num_partition_kinds: int


class PartitionParser:
    """Reads a server's partition from its naming-service tag (brpc's PartitionParser).

    This base reads "N/M" (partition N of M, decimal, blanks around the numbers allowed), the
    form of brpc's examples. Subclass and override `parse` for another form; returning None,
    or raising, leaves the server out (logged).
    """

    def parse(self, tag: str) -> Partition | None:
        """The partition `tag` names, or None when it names none."""
        match = _SLASH_TAG.fullmatch(tag)
        if match is None:
            return None
        return Partition(int(match.group(1)), int(match.group(2)))


DEFAULT_PARTITION_PARSER = PartitionParser()


@dataclass
class PartitionChannelOptions(ChannelOptions):
    """ChannelOptions of the partitions' channels, plus how a call spans the partitions
    (brpc's PartitionChannelOptions).

    `timeout_ms` is the deadline of a call over all partitions; the partitions' calls retry
    and send backups as `max_retry` and `backup_request_ms` say.

    Attributes:
        fail_limit: The call fails once this many partitions failed (the others cancelled).
            None: all of them (the call fails only when every partition fails).
        call_mapper: A `CallMapper` shared by every partition: what each partition is sent
            (`channel_index` is the partition's index, `channel_count` their number).
        response_merger: A `ResponseMerger` shared by every partition.
    """

    fail_limit: int | None = None
    call_mapper: Any = None
    response_merger: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        ParallelChannelOptions(timeout_ms=self.timeout_ms, fail_limit=self.fail_limit)  # its checks
        if self.call_mapper is not None and not callable(getattr(self.call_mapper, "map", None)):
            raise TypeError(f"call_mapper must be a CallMapper, got {type(self.call_mapper).__name__}")
        if self.response_merger is not None and not callable(getattr(self.response_merger, "merge", None)):
            raise TypeError(f"response_merger must be a ResponseMerger, got {type(self.response_merger).__name__}")


def check_partition_args(load_balancer: str, options: Any, partition_parser: Any) -> PartitionChannelOptions:
    """The options to use; TypeError/ValueError for bad arguments (an unknown balancer too)."""
    if not isinstance(load_balancer, str):
        raise TypeError(f"load_balancer must be a load balancer name like 'rr', got {type(load_balancer).__name__}")
    create_load_balancer(load_balancer)  # ValueError naming the known ones
    if options is None:
        options = PartitionChannelOptions()
    elif not isinstance(options, PartitionChannelOptions):
        raise TypeError(f"options must be a PartitionChannelOptions, got {type(options).__name__}")
    if partition_parser is not None and not callable(getattr(partition_parser, "parse", None)):
        raise TypeError(f"partition_parser must be a PartitionParser (a parse method), "
                        f"got {type(partition_parser).__name__}")
    return options


def parse_partition(parser: Any, server: ServerNode) -> tuple[Partition | None, str]:
    """`server`'s partition and "", or None and why its tag names none (or a nonsense one)."""
    try:
        part = parser.parse(server.tag)
    except Exception as e:
        return None, f"partition_parser.parse({server.tag!r}) raised {e!r}"
    if part is None:
        return None, f"its tag {server.tag!r} names no partition"
    if not isinstance(part, Partition):
        return None, f"partition_parser.parse({server.tag!r}) returned {part!r}, not a Partition"
    if not 0 < part.num_partition_kinds <= MAX_SUB_CHANNELS:
        return None, (f"its tag {server.tag!r} names {part.num_partition_kinds} partitions "
                      f"(1..{MAX_SUB_CHANNELS} supported)")
    if not 0 <= part.index < part.num_partition_kinds:
        return None, f"its tag {server.tag!r} names partition {part.index} of {part.num_partition_kinds}"
    return part, ""


class SkipLog:
    """Logs each server left out of a list once, not again at every later list that still
    has it (periodic naming services repeat their lists)."""

    def __init__(self) -> None:
        self._previous: set[ServerNode] = set()
        self._current: set[ServerNode] = set()

    def new_list(self) -> None:
        self._previous, self._current = self._current, set()

    def skip(self, server: ServerNode, why: str) -> None:
        self._current.add(server)
        if server not in self._previous:
            log.warning("server %s is left out: %s", server, why)


def short_name(naming_url) -> str:
    """`naming_url` cut to 64 characters: it names the partitions in error texts."""
    text = str(naming_url)
    return text if len(text) <= 64 else text[:61] + "..."


class Partitioning:
    """One partitioning of a service: a Channel per partition, over that partition's
    servers (balanced by `load_balancer`), under a ParallelChannel."""

    def __init__(self, num_partitions: int, load_balancer: str, options: PartitionChannelOptions, name: str) -> None:
        self.num_partitions = num_partitions
        self.feeds = [ServerFeed(f"partition {i}/{num_partitions} of {name}") for i in range(num_partitions)]
        self.channels = [Channel(feed, options, load_balancer=load_balancer) for feed in self.feeds]
        self.fail_limit = options.fail_limit
        self.parallel = ParallelChannel(ParallelChannelOptions(timeout_ms=options.timeout_ms,
                                                               fail_limit=options.fail_limit))
        for ch in self.channels:
            self.parallel.add_channel(ch, options.call_mapper, options.response_merger)

    def set_servers(self, by_partition: list[list[ServerNode]]) -> None:
        """The servers of each partition (a list per partition index)."""
        for feed, servers in zip(self.feeds, by_partition):
            feed.set_servers(servers)

    def server_count(self) -> int:
        return sum(len(feed.servers) for feed in self.feeds)

    def capacity(self) -> int:
        """The fewest servers of a partition: how many calls it serves at once, in server
        units (brpc: a ParallelChannel's weight is its smallest sub-channel's)."""
        return min(len(feed.servers) for feed in self.feeds)

    def _partition_healthy(self, i: int) -> bool:
        if not self.feeds[i].servers:
            return False
        states = self.channels[i].server_states()
        return not states or any(state == "up" for state in states.values())  # none yet: not called yet

    def check_health(self) -> bool:
        """Whether enough partitions have a server up for a call to succeed (as
        ParallelChannel.check_health)."""
        need = self.num_partitions - (self.fail_limit - 1 if self.fail_limit else 0)
        return need <= 0 or sum(self._partition_healthy(i) for i in range(self.num_partitions)) >= need

    def sub_channels(self) -> list:
        return list(self.channels)

    async def call_method(self, service_name: str, method_name: str, request, response_class,
                          cntl: Controller | None = None):
        return await self.parallel.call_method(service_name, method_name, request, response_class, cntl)

    async def close(self) -> None:
        await close_all(self.channels)

    def __repr__(self) -> str:
        return f"<Partitioning {self.num_partitions} partitions, {self.server_count()} servers>"


class PartitionChannel:
    """A call to every partition of a sharded service, the responses merged.

    The servers come from `naming_url` (any naming service: `list://`, `file://` ...); each
    server's tag is read by `partition_parser` (by default "N/M": partition N of M). The
    servers of partition i of `num_partition_kinds` serve partition i, balanced by
    `load_balancer` ("rr" by default, any registered name); servers whose tag names no
    partition, or another number of partitions, are left out (logged once). Each call goes
    to every partition concurrently, as through a ParallelChannel: `options.call_mapper`
    decides what partition i is sent, `options.response_merger` merges the partitions'
    responses, `options.fail_limit` how many partitions may fail, `options.timeout_ms` the
    deadline of the whole call. `combo.sub_controller(cntl, i)` is partition i's controller.

    A partition with no server fails its part of each call with ENODATA; the lists are
    followed as they change. 1 to 1024 partitions.
    """

    def __init__(self, num_partition_kinds: int, naming_url: str, load_balancer: str = "rr",
                 options: PartitionChannelOptions | None = None, *,
                 partition_parser: PartitionParser | None = None) -> None:
        n = num_partition_kinds
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_SUB_CHANNELS:
            raise ValueError(f"num_partition_kinds must be an int in 1..{MAX_SUB_CHANNELS}, got {n!r}")
        self.options = check_partition_args(load_balancer, options, partition_parser)
        self.partition_parser = partition_parser or DEFAULT_PARTITION_PARSER
        self._skips = SkipLog()
        self.partitions = Partitioning(n, load_balancer, self.options, short_name(naming_url))
        self.naming = NamingFollower(naming_url, self._set_servers)

    @property
    def partition_count(self) -> int:
        return self.partitions.num_partitions

    def _set_servers(self, servers: list[ServerNode]) -> None:
        n = self.partitions.num_partitions
        by_partition: list[list[ServerNode]] = [[] for _ in range(n)]
        self._skips.new_list()
        for server in servers:
            part, why = parse_partition(self.partition_parser, server)
            if part is None:
                self._skips.skip(server, why)
            elif part.num_partition_kinds != n:
                self._skips.skip(server, f"its tag {server.tag!r} is of {part.num_partition_kinds} partitions, "
                                         f"not {n}")
            else:
                by_partition[part.index].append(server)
        self.partitions.set_servers(by_partition)

    def sub_channels(self) -> list:
        return self.partitions.sub_channels()

    def check_health(self) -> bool:
        return self.partitions.check_health()

    async def call_method(self, service_name: str, method_name: str, request, response_class,
                          cntl: Controller | None = None):
        """Call `service_name`/`method_name` on every partition; return the merged response.

        Raises RpcError on failure (also recorded in `cntl`)."""
        cntl = begin(cntl, service_name, method_name)
        started = await wait_for_servers(self.naming, self.options, cntl)
        return await self.partitions.parallel._call(service_name, method_name, request, response_class, cntl,
                                                    started)

    async def close(self) -> None:
        """Stop following the naming service and close the partitions' channels."""
        await self.naming.close()
        await self.partitions.close()

    async def __aenter__(self) -> PartitionChannel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<PartitionChannel {self.naming.url} {self.partitions.num_partitions} partitions>"


async def wait_for_servers(naming: NamingFollower, options: ChannelOptions, cntl: Controller) -> float:
    """Follow `naming` from the running loop and wait (within the call's deadline) for its
    first list; the loop time the call started. RpcError(ENODATA) when the service failed
    before giving any list."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    if naming.static:
        return started
    start_ns = time.perf_counter_ns()
    timeout_ms = options.timeout_ms if cntl.timeout_ms is None else cntl.timeout_ms
    try:
        await naming.ready(None if timeout_ms < 0 else timeout_ms / 1000)
        if not naming.has_list and naming.error:
            raise RpcError(ENODATA, f"Fail to select server: {naming.error}")
    except RpcError as e:
        cntl.latency_us = (time.perf_counter_ns() - start_ns) // 1000
        raise fail(cntl, e.code, e.text) from None
    return started
