"""A cluster behind one channel: retries, backup requests, and what the channel counted.

    python examples/cluster.py

Three servers run in this process on ephemeral ports: "fast", "slow" (answers after 200 ms)
and one that is down (nothing listens on its port any more). A `list://` channel calls them
round robin with `max_retry=2` and `backup_request_ms=30`:

* an attempt sent to the down server fails to connect (ECONNREFUSED): the call is retried on
  another server, and the down server is skipped from then on while its health check probes
  it in the background (`channel.server_states()`);
* an attempt sent to the slow server has no reply after 30 ms, so the same request goes to
  another server too: the first reply wins, `cntl.has_backup_request` is True, and the backup
  counts in `cntl.retried_count`.

`cntl.attempts` lists every attempt (server and result; None: abandoned), `channel.stats`
counts what the channel did.
"""

from __future__ import annotations

import asyncio

import aiobrpc
from aiobrpc._proto import echo_pb2  # example.EchoService, from proto/echo.proto

ECHO = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]


class Backend(aiobrpc.Servicer):
    SERVICE = ECHO

    def __init__(self, name: str, delay_s: float = 0.0) -> None:
        self.name = name
        self.delay_s = delay_s

    async def Echo(self, request, cntl):
        await asyncio.sleep(self.delay_s)
        return echo_pb2.EchoResponse(message=f"{request.message} from {self.name}")


async def start(servicer: aiobrpc.Servicer) -> aiobrpc.Server:
    server = aiobrpc.Server()
    server.add_service(servicer)
    await server.start("127.0.0.1:0")  # port 0: any free port
    return server


async def main() -> None:
    fast = await start(Backend("fast"))
    slow = await start(Backend("slow", delay_s=0.2))
    down = await start(Backend("down"))
    await down.join()  # stopped: its port now refuses connections
    names = {fast.address: "fast", slow.address: "slow", down.address: "down"}

    options = aiobrpc.ChannelOptions(timeout_ms=1000, max_retry=2, backup_request_ms=30)
    url = f"list://{fast.address},{slow.address},{down.address}"
    async with aiobrpc.Channel(url, options, load_balancer="rr") as channel:
        stub = aiobrpc.Stub(channel, ECHO)
        for i in range(6):
            cntl = aiobrpc.Controller()
            resp = await stub.Echo(echo_pb2.EchoRequest(message=f"call {i}"), cntl)
            tried = ", ".join(f"{names[a.remote_side]}:{'ok' if a.error_code == 0 else a.error_code}"
                              for a in cntl.attempts)
            print(f"{resp.message:<16} retried_count={cntl.retried_count} "
                  f"has_backup_request={cntl.has_backup_request!s:<5} attempts=[{tried}]")
        print(channel.stats)
        print({names[address]: state for address, state in channel.server_states().items()})
    for server in (fast, slow):
        await server.stop()
        await server.join()


if __name__ == "__main__":
    asyncio.run(main())
