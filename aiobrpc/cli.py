"""The `aiobrpc` command (also `python -m aiobrpc`).

    aiobrpc demo [--seconds 5] [--concurrency 64] [--size 16] [--loop uvloop|asyncio]
    aiobrpc call 127.0.0.1:8000 example.EchoService/Echo --proto proto/echo.proto -d '{"message": "hi"}'
    aiobrpc call list://10.0.0.1:8000,10.0.0.2:8000 example.EchoService/Echo --proto proto/echo.proto --lb rr
    aiobrpc serve-echo --port 8000
    aiobrpc serve my_services.py --port 8000
    aiobrpc press --proto proto/echo.proto --method example.EchoService/Echo --server 127.0.0.1:8000 \
        --request '{"message": "hi"}' --qps 1000 --duration 10

Exit status: 0 success, 1 the RPC (or the server, or a call of `press`) failed, 2 usage
error. User errors and a failed call are reported in one line, never with a traceback;
`call -v` adds what each attempt did and the library's log. docs/cli.md tells more.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time

from . import __version__, _fast, implementation
from ._proto import echo_pb2
from .client import lb
from .client.channel import Channel
from .client.naming import is_naming_url
from .client.naming.list import ListNamingService
from .controller import Controller
from .errors import RpcError, describe
from .options import ChannelOptions, ServerOptions
from .server.server import Server
from .stub import Servicer, Stub, message_class

ECHO_SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]


class UsageError(Exception):
    """Bad arguments found after parsing (address, files, JSON): exit status 2."""


class _Parser(argparse.ArgumentParser):
    """Reports a usage error in one line (argparse prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class EchoServiceImpl(Servicer):
    """brpc's example echo service: message and attachment come back as sent.

    A request with sleep_ms > 0 is answered that much later, to try timeouts.
    """

    SERVICE = ECHO_SERVICE

    async def Echo(self, request, cntl):
        if request.sleep_ms > 0:
            await asyncio.sleep(request.sleep_ms / 1000)
        cntl.response_attachment = cntl.request_attachment
        return echo_pb2.EchoResponse(message=request.message)


# -- event loops -----------------------------------------------------------------------------
def _loop_factory(name: str | None):
    if name in (None, "uvloop"):
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise UsageError("uvloop is not installed: `pip install uvloop` or use --loop asyncio") from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def _run(coro, loop_name: str | None = None):
    try:
        factory = _loop_factory(loop_name)
    except UsageError:
        coro.close()
        raise
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro)
    loop = factory()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


# -- demo ------------------------------------------------------------------------------------
class _Load:
    __slots__ = ("latencies_ns", "errors", "first_error")

    def __init__(self) -> None:
        self.latencies_ns = array.array("q")  # of successful calls only, as brpc's rpc_press
        self.errors = 0
        self.first_error = ""

    @property
    def calls(self) -> int:
        return len(self.latencies_ns) + self.errors

    def fail(self, text: str) -> None:
        self.errors += 1
        if not self.first_error:
            self.first_error = text


async def _caller(stub: Stub, payload: bytes | None, deadline: float, load: _Load) -> None:
    loop = asyncio.get_running_loop()
    request = echo_pb2.EchoRequest(message="aiobrpc")
    size = len(payload) if payload else 0
    latencies = load.latencies_ns
    clock = time.perf_counter_ns
    while loop.time() < deadline:
        cntl = Controller(request_attachment=payload)
        start = clock()
        try:
            response = await stub.Echo(request, cntl)
        except RpcError as e:
            load.fail(str(e))
            continue
        elapsed = clock() - start
        attachment = cntl.response_attachment
        if response.message != request.message or (len(attachment) if attachment is not None else 0) != size:
            load.fail("the echo differs from the request")
            continue
        latencies.append(elapsed)


async def _demo(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    server = Server(ServerOptions())
    server.add_service(EchoServiceImpl())
    await server.start("127.0.0.1:0")
    channel = Channel(server.address, ChannelOptions())
    load = _Load()
    loop = asyncio.get_running_loop()
    loop_name = type(loop).__module__.partition(".")[0]
    try:
        stub = Stub(channel, ECHO_SERVICE)
        payload = os.urandom(args.size) if args.size else None
        console.print(f"aiobrpc demo: {args.concurrency} callers -> {server.address} for "
                      f"{args.seconds:g} s ({loop_name}, _fast={_fast.IMPLEMENTATION})")
        progress = Progress(TextColumn("[bold]echo"), BarColumn(), TimeElapsedColumn(),
                            TextColumn("{task.fields[qps]}"), console=console, transient=True,
                            auto_refresh=False, disable=not console.is_terminal)
        with progress:
            bar = progress.add_task("echo", total=args.seconds, qps="")
            start = time.perf_counter()
            deadline = loop.time() + args.seconds
            callers = [loop.create_task(_caller(stub, payload, deadline, load))
                       for _ in range(args.concurrency)]
            everyone = asyncio.gather(*callers)
            try:
                while not everyone.done():
                    await asyncio.wait([everyone], timeout=0.1)
                    elapsed = time.perf_counter() - start
                    progress.update(bar, completed=min(elapsed, args.seconds),
                                    qps=f"{load.calls / elapsed:,.0f} QPS")
                    progress.refresh()
                await everyone
            finally:
                for t in callers:
                    t.cancel()
                await asyncio.gather(everyone, return_exceptions=True)
            elapsed = time.perf_counter() - start
    finally:
        await channel.close()
        await server.stop()
        await server.join()
    console.print(_summary(args, load, elapsed, loop_name))
    if not load.latencies_ns:
        print(f"aiobrpc demo: no call succeeded: {load.first_error}", file=sys.stderr)
        return 1
    return 0


def _summary(args, load: _Load, elapsed: float, loop_name: str):
    from rich.table import Table

    lat = sorted(load.latencies_ns)
    ok = len(lat)

    def percentile(q: float) -> str:
        if not lat:
            return "-"
        return f"{lat[max(0, math.ceil(q * ok) - 1)] / 1000:,.0f} us"

    mb_s = ok * args.size / elapsed / 1e6
    table = Table(title="aiobrpc demo", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in (
        ("loop", loop_name),
        ("_fast", _fast.IMPLEMENTATION),
        ("concurrency", f"{args.concurrency}"),
        ("attachment", f"{args.size:,} B"),
        ("duration", f"{elapsed:.2f} s"),
        ("calls", f"{load.calls:,}"),
        ("errors", f"{load.errors:,}"),
        ("QPS", f"{ok / elapsed:,.0f}"),
        ("latency p50", percentile(0.50)),
        ("latency p90", percentile(0.90)),
        ("latency p99", percentile(0.99)),
        ("latency max", f"{lat[-1] / 1000:,.0f} us" if lat else "-"),
        ("attachment MB/s", f"{mb_s:,.2f} out, {mb_s:,.2f} in"),
    ):
        table.add_row(name, value)
    if load.first_error:
        table.add_row("first error", load.first_error)
    return table


def cmd_demo(args) -> int:
    return _run(_demo(args), args.loop)


# -- call ------------------------------------------------------------------------------------


def cmd_call(args) -> int:
    from google.protobuf import json_format

    from .cli_json import parse_request
    from .cli_proto import ProtoError, compile_proto, find_method

    logging.getLogger("aiobrpc").setLevel(logging.INFO if args.verbose else logging.ERROR)
    channel = _channel(args.address, args.lb)
    try:
        method = find_method(compile_proto(args.proto, args.include), args.method)
    except ProtoError as e:
        raise UsageError(str(e)) from None
    request = message_class(method.input_type)()
    try:
        parse_request(args.data, request)
    except ProtoError as e:
        raise UsageError(f"-d: {e}") from None
    missing = request.FindInitializationErrors()
    if missing:
        raise UsageError(f"-d: {method.input_type.full_name} lacks required fields: {', '.join(missing)}")
    attachment = None
    if args.attachment_file is not None:
        try:
            with open(args.attachment_file, "rb") as f:
                attachment = f.read()
        except OSError as e:
            raise UsageError(f"cannot read attachment file {args.attachment_file}: {e.strerror}") from None
    try:
        cntl = Controller(log_id=args.log_id, timeout_ms=args.timeout_ms, request_attachment=attachment)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        response = _run(_call(channel, method, request, cntl))
    except RpcError as e:
        if args.verbose:
            _print_attempts(cntl)
        print(f"call failed: {_one_line(e)}", file=sys.stderr)
        return 1
    if args.verbose:
        _print_attempts(cntl)
    print(json_format.MessageToJson(response, preserving_proto_field_name=True))
    if args.response_attachment_file is not None:
        try:
            with open(args.response_attachment_file, "wb") as f:
                f.write(cntl.response_attachment if cntl.response_attachment is not None else b"")
        except OSError as e:
            raise UsageError(f"cannot write {args.response_attachment_file}: {e.strerror}") from None
    return 0


def _channel(address: str, lb_name: str | None, options: ChannelOptions | None = None) -> Channel:
    """A Channel to `address`, with load balancer `lb_name` (default rr) when it is a naming URL."""
    naming = is_naming_url(address)
    if lb_name is not None and not naming:
        raise UsageError(f"--lb needs a naming service ADDR like 'list://host:port,...', got {address!r}")
    try:
        if address.startswith("list://") and not ListNamingService(address).servers:
            raise ValueError(f"{address!r} lists no server: give one or more, e.g. 'list://127.0.0.1:8000,127.0.0.1:8001'")
        return Channel(address, options, load_balancer=(lb_name or "rr") if naming else None)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


async def _call(channel: Channel, method, request, cntl: Controller):
    async with channel:
        return await channel.call_method(method.containing_service.full_name, method.name, request,
                                         message_class(method.output_type), cntl)


def _print_attempts(cntl: Controller) -> None:
    for n, att in enumerate(cntl.attempts, 1):
        code = att.error_code
        result = "abandoned" if code is None else f"E{code} ({describe(code)})" if code else "ok"
        print(f"attempt {n}: server={att.remote_side or '-'} correlation_id={att.correlation_id or '-'} "
              f"result={result}{' (backup request)' if att.backup else ''}", file=sys.stderr)


def _one_line(e: RpcError) -> str:
    """`[E<code>]<text>` in one line (the code once where the text starts with it). The
    channel already tells retries that failed alike once (client/retry.retried_error_text).

    >>> _one_line(RpcError(112, "[E111]refused [R1-R2][E112]down"))
    '[E112][E111]refused [R1-R2][E112]down'
    >>> _one_line(RpcError(61, "[E61]no server [R1-R3] same"))
    '[E61]no server [R1-R3] same'
    """
    text = " ".join(e.text.split())
    code = f"[E{e.code}]"
    return text if text.startswith(code) else code + text


# -- serving ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _on_stop_signals(loop: asyncio.AbstractEventLoop, handler):
    """Within: SIGINT and SIGTERM call `handler(signum)` on `loop` instead of ending the process."""
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        try:
            loop.add_signal_handler(signum, handler, signum)
        except NotImplementedError:  # Windows: no loop signal handlers
            signal.signal(signum, lambda n, _: loop.call_soon_threadsafe(handler, n))
    try:
        yield
    finally:
        for s in signals:
            try:
                loop.remove_signal_handler(s)
            except NotImplementedError:
                signal.signal(s, signal.SIG_DFL)


async def _serve_until_signal(server: Server, label: str, args) -> int:
    """Listen on --host/--port, print where, stop gracefully on SIGINT/SIGTERM."""
    host = f"[{args.host}]" if ":" in args.host else args.host
    try:
        await server.start(f"{host}:{args.port}")
    except OSError as e:
        print(f"aiobrpc {args.command}: cannot listen on {host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    stopped = loop.create_future()

    def on_signal(signum: int) -> None:
        if not stopped.done():
            stopped.set_result(signum)

    with _on_stop_signals(loop, on_signal):
        # The bound address (port 0 picks one) on stdout, so scripts and tests can read it.
        print(f"{label} listening on {host}:{server.port}", flush=True)
        signum = await stopped
    print(f"got {signal.Signals(signum).name}, stopping", file=sys.stderr, flush=True)
    await server.stop()
    await server.join(timeout=5)
    return 0


async def _serve_echo(args) -> int:
    server = Server(ServerOptions())
    server.add_service(EchoServiceImpl())
    return await _serve_until_signal(server, "EchoService", args)


def cmd_serve_echo(args) -> int:
    return _run(_serve_echo(args))


def cmd_serve(args) -> int:
    from .cli_serve import ServeError, load_servicers

    servicers = []
    try:
        for spec in args.modules:
            servicers.extend(load_servicers(spec))
    except ServeError as e:
        raise UsageError(str(e)) from None
    try:
        server = Server(ServerOptions(max_concurrency=args.max_concurrency,
                                      has_builtin_services=not args.no_builtin_services))
        for servicer in servicers:
            server.add_service(servicer)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    label = ", ".join(s.SERVICE.full_name for s in servicers)
    return _run(_serve_until_signal(server, label, args))


# -- press -----------------------------------------------------------------------------------
def cmd_press(args) -> int:
    from . import press
    from .cli_proto import ProtoError, compile_proto, find_method

    logging.getLogger("aiobrpc").setLevel(logging.ERROR)  # a server down would log on every call
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: `pip install matplotlib` (or aiobrpc[bench])") from None
    try:
        options = ChannelOptions(**{k: v for k, v in (("timeout_ms", args.timeout_ms), ("max_retry", args.max_retry),
                                                      ("connection_type", args.connection_type)) if v is not None})
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    channel = _channel(args.server, args.lb, options)
    try:
        method = find_method(compile_proto(args.proto, args.include), args.method)
        if args.input is not None:
            try:
                with open(args.input, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ProtoError(f"cannot read --input {args.input}: {getattr(e, 'strerror', None) or e}") from None
            source = f"--input {args.input}"
        else:
            text, source = args.request, "--request"
        requests = press.read_requests(text, message_class(method.input_type), source)
    except ProtoError as e:
        raise UsageError(str(e)) from None
    attachment = os.urandom(args.attachment_size) if args.attachment_size else None
    qps = args.qps
    concurrency = args.concurrency or (64 if qps == 0 else 1024)
    run = press.Press(_press_call(channel, method, attachment), requests, qps=qps, concurrency=concurrency,
                      duration_s=args.duration, count=args.count)
    stats = _run(_press(channel, run, args))
    summary = {"method": f"{method.containing_service.full_name}/{method.name}", "server": args.server,
               "target_qps": qps, "concurrency": concurrency, **stats.summary()}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        from rich.console import Console

        Console().print(_press_table(summary))
    if args.plot is not None:
        try:
            press.write_plot(stats, args.plot, f"{summary['method']} -> {args.server}: {stats.ok:,} calls ok")
        except OSError as e:
            raise UsageError(f"cannot write {args.plot}: {e.strerror or e}") from None
    return 1 if stats.failed else 0


def _press_call(channel: Channel, method, attachment):
    service, name, response_class = method.containing_service.full_name, method.name, message_class(method.output_type)
    call_method = channel.call_method
    if attachment is None:
        return lambda request: call_method(service, name, request, response_class)
    return lambda request: call_method(service, name, request, response_class,
                                       Controller(request_attachment=attachment))


async def _press(channel: Channel, run, args):
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    loop = asyncio.get_running_loop()
    console = Console(stderr=True)
    live = None
    if not args.quiet and console.is_terminal:
        live = Live(Text(""), console=console, transient=True, auto_refresh=False)
    progress = None if args.quiet else loop.create_task(_progress(run, live))
    async with channel:
        with _on_stop_signals(loop, lambda _: run.stop()), live if live is not None else contextlib.nullcontext():
            try:
                return await run.run()
            finally:
                if progress is not None:
                    progress.cancel()
                    await asyncio.gather(progress, return_exceptions=True)


async def _progress(run, live) -> None:
    """Once a second (on the terminal: a live line, else a plain line on stderr): calls, the
    QPS and mean latency of the last second, failures."""
    from rich.text import Text

    loop = asyncio.get_running_loop()
    stats = run.stats
    lat = stats.latency
    last_t, last_calls, last_ok, last_sum = loop.time(), 0, 0, 0
    while True:
        await asyncio.sleep(1)
        now = loop.time()
        calls, ok, sum_ns = stats.calls, lat.count, lat.sum_ns
        mean = f"{(sum_ns - last_sum) / (ok - last_ok) / 1000:,.0f} us" if ok > last_ok else "-"
        qps = (calls - last_calls) / (now - last_t)
        line = (f"{now - run.start_time:6.1f} s  {calls:>10,} calls  {qps:>9,.0f} QPS  mean {mean}  "
                f"failed {stats.failed:,}" + (f"  skipped {stats.skipped:,}" if stats.skipped else ""))
        if live is not None:
            live.update(Text(line), refresh=True)
        else:
            print(line, file=sys.stderr, flush=True)
        last_t, last_calls, last_ok, last_sum = now, calls, ok, sum_ns


def _press_table(summary: dict):
    from rich.table import Table

    table = Table(title="aiobrpc press", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    target = f" (target {summary['target_qps']:,g})" if summary["target_qps"] else ""
    rows = [("method", summary["method"]), ("server", summary["server"]), ("calls", f"{summary['calls']:,}"),
            ("ok", f"{summary['ok']:,}"), ("failed", f"{summary['failed']:,}")]
    if summary["skipped"]:
        rows.append(("skipped", f"{summary['skipped']:,}"))
    rows += [("duration", f"{summary['elapsed_s']:.2f} s"), ("QPS", f"{summary['qps']:,.1f}{target}"),
             ("concurrency", f"{summary['concurrency']:,}")]
    for name, us in summary["latency_us"].items():
        rows.append((f"latency {name}", "-" if us is None else f"{us:,.0f} us"))
    for e in summary["errors"]:
        rows.append((f"E{e['code']} {e['name'] or ''}".rstrip(), f"{e['count']:,}  {e['text']}"))
    for row in rows:
        table.add_row(*row)
    return table


# -- command line ----------------------------------------------------------------------------
def _int_in(low: int, high: int = 2**63 - 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value
    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _float_at_least(low: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not low <= value < math.inf:
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {text}")
        return value
    return parse


def _load_balancer(text: str) -> str:
    try:
        name, _ = lb.parse_lb_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if name not in _load_balancers():
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(_load_balancers())})")
    return text


def _load_balancers() -> list[str]:
    return sorted(lb._REGISTRY)


def version() -> str:
    """`aiobrpc 0.1.0 (compiled: cython)` or `(pure python)`: the version and the active hot path."""
    impl = implementation()
    return f"aiobrpc {__version__} ({'pure python' if impl == 'python' else f'compiled: {impl}'})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="aiobrpc", description="brpc's baidu_std protocol on asyncio.")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="load an embedded echo server and print QPS and latency",
                       description="Start an echo server in this process, call it from N concurrent "
                                   "callers over one Channel, print QPS and latency percentiles.")
    p.add_argument("--seconds", type=_positive_seconds, default=5.0, help="duration (default 5)")
    p.add_argument("--concurrency", type=_int_in(1), default=64,
                   help="concurrent callers (default 64)")
    p.add_argument("--size", type=_int_in(0, 2**31 - 1), default=16,
                   help="attachment bytes per request, echoed back (default 16)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default=None,
                   help="event loop (default uvloop when installed)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("call", help="call one method, request and response as JSON",
                       description="Compile the .proto, call METHOD at ADDR with the JSON request, "
                                   "print the JSON response.")
    p.add_argument("address", metavar="ADDR",
                   help="host:port, [ipv6]:port, or a naming service URL such as list://host:port,host:port")
    p.add_argument("method", metavar="METHOD", help="package.Service/Method")
    p.add_argument("--proto", required=True, help=".proto file defining the service")
    p.add_argument("-I", "--proto-path", dest="include", action="append", default=[], metavar="DIR",
                   help="import directory (repeatable; default: the directory of --proto)")
    p.add_argument("-d", "--data", default="{}", help="request as JSON (default {})")
    p.add_argument("--timeout-ms", type=_int_in(-1, 2**31 - 1), default=None,
                   help="timeout of the whole call, -1 for none (default 500)")
    p.add_argument("--log-id", type=_int_in(0, 2**64 - 1), default=None, help="log_id sent in the request meta")
    p.add_argument("--attachment-file", metavar="PATH", help="send the bytes of PATH as the attachment")
    p.add_argument("--response-attachment-file", metavar="PATH",
                   help="write the response attachment to PATH")
    p.add_argument("--lb", type=_load_balancer, default=None, metavar="NAME",
                   help=f"load balancer of a naming service ADDR: {', '.join(_load_balancers())} (default rr)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print what each attempt did (server, correlation id, result) and the library's log")
    p.set_defaults(func=cmd_call)

    p = sub.add_parser("serve-echo", help="run an echo server until SIGINT/SIGTERM",
                       description="Serve example.EchoService (proto/echo.proto) until SIGINT or "
                                   "SIGTERM, then stop gracefully.")
    p.add_argument("--port", type=_int_in(0, 65535), default=8000, help="port (default 8000; 0 = any free)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.set_defaults(func=cmd_serve_echo)

    p = sub.add_parser("serve", help="serve the servicers of a Python module until SIGINT/SIGTERM",
                       description="Import MODULE (a .py file or a dotted name) and serve its aiobrpc.Servicer "
                                   "subclasses (every one defined there, made with no argument, or those named "
                                   "after ':') until SIGINT or SIGTERM, then stop gracefully.")
    p.add_argument("modules", nargs="+", metavar="MODULE[:ATTR[,ATTR]]",
                   help="path/to/services.py or pkg.services, optionally :Servicer names (classes or instances)")
    p.add_argument("--port", type=_int_in(0, 65535), default=8000, help="port (default 8000; 0 = any free)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--max-concurrency", type=_int_in(0), default=0,
                   help="requests handled at once; more are answered ELIMIT (default 0: no limit)")
    p.add_argument("--no-builtin-services", action="store_true",
                   help="do not serve the builtin HTTP pages (/status, /vars, ...) on the port")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("press", help="load a server with calls of one method; print QPS, latency, errors",
                       description="Call METHOD of the server with the JSON requests (round robin) at a fixed "
                                   "QPS or as fast as possible, for a duration or a number of calls (neither: "
                                   "until SIGINT/SIGTERM); print the latency percentiles and the errors by "
                                   "code. Exit status 1 when a call failed.")
    p.add_argument("--proto", required=True, help=".proto file defining the service")
    p.add_argument("-I", "--proto-path", dest="include", action="append", default=[], metavar="DIR",
                   help="import directory (repeatable; default: the directory of --proto)")
    p.add_argument("--method", required=True, help="package.Service/Method")
    p.add_argument("--server", required=True, metavar="ADDR",
                   help="host:port, [ipv6]:port, or a naming service URL such as list://host:port,host:port")
    p.add_argument("--lb", type=_load_balancer, default=None, metavar="NAME",
                   help=f"load balancer of a naming service ADDR: {', '.join(_load_balancers())} (default rr)")
    requests = p.add_mutually_exclusive_group()
    requests.add_argument("--input", metavar="FILE",
                          help="JSON requests: an array, or one object per line (or one after another)")
    requests.add_argument("--request", default="{}", help="one request as JSON (default {})")
    p.add_argument("--qps", type=_float_at_least(0), default=0,
                   help="calls started per second, on a fixed schedule (default 0: as fast as possible)")
    p.add_argument("--concurrency", type=_int_in(1), default=None,
                   help="most calls in flight (default 64; 1024 with --qps)")
    p.add_argument("--duration", type=_positive_seconds, default=None, help="seconds to run")
    p.add_argument("--count", type=_int_in(1), default=None, help="calls to make")
    p.add_argument("--timeout-ms", type=_int_in(-1, 2**31 - 1), default=None,
                   help="timeout of each call, -1 for none (default 500)")
    p.add_argument("--max-retry", type=_int_in(0, 1000), default=None, help="retries of a failed call (default 3)")
    p.add_argument("--connection-type", choices=("single", "pooled", "short"), default=None,
                   help="connections to the server (default single)")
    p.add_argument("--attachment-size", type=_int_in(0, 2**31 - 1), default=0,
                   help="bytes of random attachment sent with each request (default 0)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="write a histogram of the latencies (needs matplotlib)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    p.set_defaults(func=cmd_press)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except UsageError as e:
        text = " ".join(str(e).split())  # some protobuf messages span lines
        print(f"aiobrpc {args.command}: error: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
