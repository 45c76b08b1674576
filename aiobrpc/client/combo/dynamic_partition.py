"""DynamicPartitionChannel: servers of several partitionings at once (3 and 4 partitions
during a migration), each call sent to one partitioning, chosen in proportion to its
capacity (brpc's DynamicPartitionChannel, docs/en/combo_channel.md)."""

from __future__ import annotations

import asyncio
import logging

from ...controller import Controller
from ..naming import ServerNode
from .controllers import begin
from .dynpart import DynPartLoadBalancer
from .follow import NamingFollower
from .members import close_all
from .partition import (DEFAULT_PARTITION_PARSER, PartitionChannelOptions, PartitionParser, Partitioning, SkipLog,
                        check_partition_args, parse_partition, short_name, wait_for_servers)
from .selective import SelectiveChannel

log = logging.getLogger(__name__)

#: The most partitionings a DynamicPartitionChannel keeps at once (brpc's _dynpart handles 8);
#: servers of more are left out (logged).
MAX_PARTITIONINGS = 8


class DynamicPartitionChannel:
    """Calls a sharded service whose servers may belong to several partitionings at once.

    The servers of `naming_url` are grouped by the number of partitions their tag names
    (`partition_parser`, "N/M" by default); each group is a partitioning, called as a
    PartitionChannel of that many partitions (`load_balancer` within each partition,
    `options.call_mapper`, `options.response_merger`, `options.fail_limit` across them). A
    SelectiveChannel with the `_dynpart` balancer sends each call to one partitioning, at
    random in proportion to its capacity: the fewest servers of one of its partitions (0 for
    a partitioning missing a partition, which then gets no call while another has capacity).
    Traffic moves as servers come and go; a partitioning left with no server is dropped.

    `options` also give the selective level its `timeout_ms` (the deadline of a call),
    `max_retry` (a call whose partitioning fails with a retryable error, ENODATA or
    EHOSTDOWN among them, is retried on another partitioning) and backup request. The
    mapper's `channel_count` is the chosen partitioning's number of partitions.
    `combo.sub_controller(cntl, 0)` is the controller of the partitioning's call, whose own
    sub-controllers are the partitions'. At most 8 partitionings, each of 1 to 1024 partitions.
    """

    def __init__(self, naming_url: str, load_balancer: str = "rr", options: PartitionChannelOptions | None = None,
                 *, partition_parser: PartitionParser | None = None) -> None:
        self.options = check_partition_args(load_balancer, options, partition_parser)
        self.load_balancer = load_balancer
        self.partition_parser = partition_parser or DEFAULT_PARTITION_PARSER
        self._schan = SelectiveChannel(DynPartLoadBalancer(self._capacity_of), self.options)
        self._partitionings: dict[int, tuple[Partitioning, ServerNode]] = {}
        self._by_handle: dict[ServerNode, Partitioning] = {}
        self._retired: set = set()  # partitionings dropped, and the tasks closing them
        self._skips = SkipLog()
        self._name = short_name(naming_url)
        self.naming = NamingFollower(naming_url, self._set_servers)

    def _capacity_of(self, handle: ServerNode) -> int:
        part = self._by_handle.get(handle)
        return part.capacity() if part is not None else 0

    def capacities(self) -> dict[int, int]:
        """The capacity of each partitioning, by its number of partitions."""
        return {n: p.capacity() for n, (p, _) in sorted(self._partitionings.items())}

    def _set_servers(self, servers: list[ServerNode]) -> None:
        groups: dict[int, list[list[ServerNode]]] = {}
        self._skips.new_list()
        for server in servers:
            part, why = parse_partition(self.partition_parser, server)
            if part is None:
                self._skips.skip(server, why)
                continue
            n = part.num_partition_kinds
            if n not in groups:
                groups[n] = [[] for _ in range(n)]
            groups[n][part.index].append(server)
        # Past MAX_PARTITIONINGS, the partitionings in use stay and new ones wait.
        order = sorted(groups, key=lambda n: n not in self._partitionings)
        for n in order[MAX_PARTITIONINGS:]:
            for server in (s for servers_of in groups.pop(n) for s in servers_of):
                self._skips.skip(server, f"its tag {server.tag!r} is of {n} partitions, and "
                                         f"{MAX_PARTITIONINGS} partitionings are in use already")
        for n in [n for n in self._partitionings if n not in groups]:
            self._drop(n)
        for n, by_partition in groups.items():
            entry = self._partitionings.get(n)
            if entry is None:
                part = Partitioning(n, self.load_balancer, self.options, self._name)
                handle = self._schan.add_channel(part)
                self._partitionings[n] = (part, handle)
                self._by_handle[handle] = part
                log.info("%s: a partitioning of %d partitions appeared", self, n)
            else:
                part = entry[0]
            part.set_servers(by_partition)

    def _drop(self, n: int) -> None:
        part, handle = self._partitionings.pop(n)
        del self._by_handle[handle]
        self._schan.remove_channel(handle)
        part.set_servers([[] for _ in range(n)])
        log.info("%s: the partitioning of %d partitions has no server left; dropped", self, n)
        try:
            task = asyncio.get_running_loop().create_task(part.close())
        except RuntimeError:  # no loop runs: close() closes it
            self._retired.add(part)
        else:
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)

    def sub_channels(self) -> list:
        return self._schan.sub_channels()

    def check_health(self) -> bool:
        return self._schan.check_health()

    async def call_method(self, service_name: str, method_name: str, request, response_class,
                          cntl: Controller | None = None):
        """Call `service_name`/`method_name` on one partitioning; return its merged response.

        Raises RpcError on failure (also recorded in `cntl`)."""
        cntl = begin(cntl, service_name, method_name)
        started = await wait_for_servers(self.naming, self.options, cntl)
        return await self._schan._call(service_name, method_name, request, response_class, cntl, started)

    async def close(self) -> None:
        """Stop following the naming service and close every partitioning's channels."""
        await self.naming.close()
        retired, self._retired = self._retired, set()
        tasks = [t for t in retired if isinstance(t, asyncio.Task)]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await close_all([p for p in retired if not isinstance(p, asyncio.Task)]
                        + [p for p, _ in self._partitionings.values()])

    async def __aenter__(self) -> DynamicPartitionChannel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<DynamicPartitionChannel {self._name} {sorted(self._partitionings)} partitions>"
