"""numpy arrays as attachments: sent without a copy, a large one received without a copy too.

    python examples/numpy_attachments.py

The array's bytes travel as the attachment; its dtype and shape travel beside them, here in
user fields (a field of the request message works as well). The server doubles the array.

* Sending: `cntl.request_attachment = array` queues the array's own buffer, no copy. The
  array must be C-contiguous (a transposed or sliced view is not: the call fails with
  EREQUEST), so `np.ascontiguousarray` it first, and must not change until the call returns.
* Receiving: `cntl.response_attachment` is a memoryview: of the buffer the reply was received
  into for a large array (no copy), of its own copy for a small one (under a quarter of that
  buffer). `np.frombuffer` on it is a view too, valid for as long as it is referenced, and
  keeps at most 4x its size alive: `.copy()` a large one to keep only its bytes.
"""

from __future__ import annotations

import asyncio
import sys

try:
    import numpy as np
except ModuleNotFoundError:
    sys.exit("numpy is not installed: pip install numpy")

import aiobrpc
from aiobrpc._proto import echo_pb2  # example.EchoService, from proto/echo.proto


def array_fields(a: np.ndarray) -> dict[str, str]:
    """dtype and shape as user fields; `dtype.str` names the byte order too ('<f4')."""
    return {"dtype": a.dtype.str, "shape": ",".join(map(str, a.shape))}


def array_view(attachment: memoryview, fields: dict[str, str]) -> np.ndarray:
    """The array in `attachment`, without a copy."""
    shape = tuple(int(n) for n in fields["shape"].split(",") if n)
    return np.frombuffer(attachment, dtype=np.dtype(fields["dtype"])).reshape(shape)


class Doubler(aiobrpc.Servicer):
    SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]

    async def Echo(self, request, cntl):
        try:
            a = array_view(cntl.request_attachment, cntl.request_user_fields)
        except (KeyError, ValueError, TypeError) as e:  # fields missing, or not matching the bytes
            raise aiobrpc.RpcError(aiobrpc.errors.EREQUEST, f"not an array: {e}") from None
        result = a * 2  # a new, C-contiguous array
        cntl.response_attachment = result  # sent without a copy
        cntl.response_user_fields = array_fields(result)
        return echo_pb2.EchoResponse(message=f"doubled {a.dtype} {a.shape}")


async def main() -> None:
    async with aiobrpc.Server() as server:
        server.add_service(Doubler())
        await server.start("127.0.0.1:0")
        async with aiobrpc.Channel(server.address) as channel:
            stub = aiobrpc.Stub(channel, Doubler.SERVICE)

            async def double(a: np.ndarray) -> np.ndarray:
                cntl = aiobrpc.Controller()
                cntl.request_attachment = a
                cntl.request_user_fields = array_fields(a)
                resp = await stub.Echo(echo_pb2.EchoRequest(message="array"), cntl)
                print(resp.message)
                return array_view(cntl.response_attachment, cntl.response_user_fields)

            a = np.arange(12, dtype=np.float32).reshape(3, 4)
            b = await double(a)
            print(b, f"is a view: {not b.flags.owndata}", sep="\n")

            try:
                await double(a.T)  # a transposed view is not C-contiguous
            except aiobrpc.RpcError as e:
                print(f"a.T: {e}")
            c = await double(np.ascontiguousarray(a.T))  # one copy, made by us
            assert np.array_equal(c, a.T * 2)
            kept = c.copy()  # owns its memory: the receive buffer can be reused
            print(f"kept a copy: {kept.flags.owndata}")


if __name__ == "__main__":
    asyncio.run(main())
