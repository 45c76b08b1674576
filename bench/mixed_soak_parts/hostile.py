"""The hostile client of the mixed soak: floods one server with bad connections until killed.

    python bench/mixed_soak_parts/hostile.py --port 9001 --rate 20 --seed 1

Each burst opens a connection, sends one of KINDS, reads until the server closes it (at most
2 s, then closes it itself), and prints a JSON line {"k": kind, "c": closed by the server}.
  garbage      random bytes
  prpc_huge    a baidu_std header announcing a 2 GiB body, then a few bytes
  rapid_reset  HTTP/2: 300 gRPC requests each reset at once (CVE-2023-44487)
  http_junk    an HTTP/1.1 request whose header line is 80 KiB
  slowloris    an HTTP/1.1 request one byte every 50 ms for 1 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import h2.config  # noqa: E402
import h2.connection  # noqa: E402
from h2.errors import ErrorCodes  # noqa: E402

from bench.mixed_soak_parts.common import GRPC, Msg, run  # noqa: E402

KINDS = ("garbage", "prpc_huge", "rapid_reset", "http_junk", "slowloris")
GRPC_PATH = f"/{GRPC.full_name}/Unary".encode()


def rapid_reset_bytes(n: int = 300) -> bytes:
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    c.initiate_connection()
    body = Msg(text="rr").SerializeToString()
    framed = b"\x00" + len(body).to_bytes(4, "big") + body
    for _ in range(n):
        sid = c.get_next_available_stream_id()
        c.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", GRPC_PATH),
                             (b":authority", b"x"), (b"content-type", b"application/grpc"),
                             (b"te", b"trailers")])
        c.send_data(sid, framed)
        c.reset_stream(sid, ErrorCodes.CANCEL)
    return c.data_to_send()


async def drain(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass


async def burst(port: int, kind: str, rng: random.Random) -> bool:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    closed = False
    try:
        if kind == "garbage":
            writer.write(rng.randbytes(rng.randint(1, 65536)))
        elif kind == "prpc_huge":
            writer.write(b"PRPC" + (2**31 - 1).to_bytes(4, "big") + (16).to_bytes(4, "big") + b"x" * 100)
        elif kind == "rapid_reset":
            writer.write(rapid_reset_bytes())
        elif kind == "http_junk":
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"a" * 80 * 1024 + b"\r\n\r\n")
        else:  # slowloris
            for byte in b"POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\n":
                writer.write(bytes([byte]))
                await asyncio.sleep(0.05)
                if reader.at_eof():
                    break
                if byte == ord("\n") and rng.random() < 0.1:
                    break
        await asyncio.wait_for(drain(reader), 2.0)  # not asyncio.timeout: Python 3.10 too
        closed = True
    except (OSError, asyncio.TimeoutError):
        pass
    finally:
        writer.transport.abort()
    return closed


async def flood(port: int, rate: float, seed: int) -> None:
    rng = random.Random(seed)
    running: set = set()
    loop = asyncio.get_running_loop()

    def report(kind, task):
        running.discard(task)
        print(json.dumps({"k": kind, "c": bool(not task.cancelled() and task.result())}), flush=True)

    while True:
        await asyncio.sleep(rng.expovariate(rate))
        if len(running) >= 8:
            continue
        kind = rng.choice(KINDS)
        task = loop.create_task(burst(port, kind, rng))
        running.add(task)
        task.add_done_callback(lambda t, kind=kind: report(kind, t))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rate", type=float, default=20.0, help="bursts per second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    a = ap.parse_args()
    run(lambda: flood(a.port, a.rate, a.seed), a.loop)


if __name__ == "__main__":
    main()
