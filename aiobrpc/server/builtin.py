"""The builtin pages a brpc server serves on its own port: /status, /vars, /brpc_metrics, ...

Each page is plain text for `curl` (a User-Agent with `curl/`, none, or `?console=1`), HTML
for a browser, and JSON with `?format=json` (or `Accept: application/json`) where its data is a
table. Nothing here reads a file or runs anything a URL names: an unknown path is a 404.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import json
import os
import struct
import sys
import time
import zlib
import urllib.parse
from typing import Callable

from ..metrics import PERCENTILES, prometheus_lines, underscored
from . import plot, series
from .glob import GlobError, GlobList
from .http_rpc import HttpReply, method_listing

PAGES = ("index", "status", "vars", "brpc_metrics", "health", "version", "flags", "protobufs", "connections",
         "rpcz", "favicon.ico")
_LISTED = [p for p in PAGES if p not in ("index", "favicon.ico")]  # what / links to
_TEXT = "text/plain"
_HTML = "text/html"


class Request:
    """What a page reads of an HTTP request."""

    __slots__ = ("server", "path", "query", "headers")

    def __init__(self, server, path: str, query: dict, headers: dict) -> None:
        self.server = server
        self.path = path          # the rest after the page's name, e.g. "rpc_server_*" of /vars/rpc_server_*
        self.query = query        # {name: last value}
        self.headers = headers    # lower-case names

    @property
    def console(self) -> bool:
        ua = self.headers.get("user-agent", "")
        return not ua or "curl/" in ua or self.query.get("console") == "1"

    @property
    def wants_json(self) -> bool:
        return self.query.get("format") == "json" or "application/json" in self.headers.get("accept", "")


def serve_page(name: str, req: Request) -> HttpReply:
    return _ROUTES[name](req)


def _reply(body: str, content_type: str = _TEXT, status: int = 200) -> HttpReply:
    return HttpReply(status, [("Content-Type", content_type)], body.encode())


def _json(data) -> HttpReply:
    return _reply(json.dumps(data, indent=1, sort_keys=False) + "\n", "application/json")


def _text_or_html(req: Request, title: str, text: str) -> HttpReply:
    if req.console:
        return _reply(text)
    return _reply(_page(title, f"<pre>{html.escape(text)}</pre>"), _HTML)


def _page(title: str, body: str) -> str:
    # The empty icon: a browser asks no /favicon.ico (a 404 it would log as a console error).
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<link rel=\"icon\" href=\"data:,\"><style>{_STYLE}</style></head>"
            f"<body><p class=\"nav\"><a href=\"/\">aiobrpc server</a></p><h1>{html.escape(title)}</h1>\n{body}\n"
            f"</body></html>\n")


_STYLE = ("body{font-family:sans-serif;margin:1em 2em}table{border-collapse:collapse}"
          "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#eee}"
          ".plots{display:flex;flex-wrap:wrap;gap:8px;margin:4px 0 12px}.nav{font-size:small}")


def _plots(server, name: str, title: str) -> str:
    """The variable's last 60 seconds and 60 minutes, side by side (series.py)."""
    s = server.series.get(name) if server.series is not None else None
    seconds, minutes = (list(s.seconds), list(s.minutes)) if s is not None else ([], [])
    return (f'<div class="plots" data-var="{html.escape(name)}">'
            + plot.svg_line(seconds, title, "60 seconds", series.SECONDS)
            + plot.svg_line(minutes, title, "60 minutes", series.MINUTES) + "</div>")


# -- the server's figures ----------------------------------------------------------------------
def version_of(server) -> str:
    """ServerOptions.version, or the servicers' class names joined by "+" (as brpc makes it)."""
    if server.options.version:
        return server.options.version
    return "+".join(server.registry.servicer_names) or "unknown"


def server_summary(server) -> dict:
    limit = server.options.max_concurrency
    return {"version": version_of(server), "aiobrpc": _aiobrpc_version(),
            "non_service_error": server.stats.failed_requests - sum(
                e.status.latency.errors for m in server.registry.services.values() for e in m.values()),
            "connection_count": len(server.connections),
            "max_concurrency": limit or "unlimited", "concurrency": server.concurrency,
            "uptime_s": round(time.monotonic() - server.started_at, 3) if server.started_at else 0}


def method_figures(server) -> dict:
    """{service: {method: {count, qps, error, eps, latency, latency_50.., max_latency, concurrency}}}"""
    return {svc: {name: e.status.describe() for name, e in methods.items()}
            for svc, methods in server.registry.services.items()}


def variables(server) -> list[tuple[str, object]]:
    """Every exposed variable as (name, value), by brpc's names."""
    prefix = f"rpc_server_{server.port}"
    out: list[tuple[str, object]] = []
    for svc, methods in method_figures(server).items():
        for name, figs in methods.items():
            base = f"{prefix}_{underscored(svc + '.' + name)}"
            out.extend((f"{base}_{k}", v) for k, v in figs.items())
    s = server.stats
    summary = server_summary(server)
    out += [(f"{prefix}_connection_count", summary["connection_count"]),
            (f"{prefix}_concurrency", server.concurrency),
            (f"{prefix}_max_concurrency", server.options.max_concurrency),
            (f"{prefix}_requests", s.requests), (f"{prefix}_error", s.failed_requests),
            (f"{prefix}_non_service_error", summary["non_service_error"]),
            (f"{prefix}_uptime", summary["uptime_s"]),
            (f"{prefix}_connections_accepted", s.connections_accepted),
            (f"{prefix}_connections_refused", s.connections_refused)]
    out += [(f"{prefix}_conn_closed_{underscored(reason)}", n) for reason, n in sorted(s.closed.items())]
    out += _process_variables()
    out.append(("aiobrpc_version", _aiobrpc_version()))
    out.append(("python_version", sys.version.split()[0]))
    return sorted(out)


_PROCESS_START = time.monotonic()


def _aiobrpc_version() -> str:
    from .. import __version__  # the package imports this module while it initialises
    return __version__


def _process_variables() -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [("process_uptime", round(time.monotonic() - _PROCESS_START, 3))]
    try:
        with open("/proc/self/statm") as f:
            out.append(("process_memory_resident", int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")))
        out.append(("process_fd_count", len(os.listdir("/proc/self/fd"))))
    except OSError:  # not Linux: these two are not known
        pass
    times = os.times()
    out.append(("process_cpu_seconds", round(times.user + times.system, 3)))
    return out


# -- pages ---------------------------------------------------------------------------------------
def _index(req: Request) -> HttpReply:
    server = req.server
    lines = [f"{p}: /{p}" for p in _LISTED]
    lines.append("")
    for svc, methods in server.registry.services.items():
        lines += [f"{svc}/{m}: /{svc}/{m}" for m in methods]
    if req.console:
        return _reply("\n".join(lines) + "\n")
    links = "".join(f'<li><a href="/{p}">/{p}</a></li>' for p in _LISTED)
    # A method is called with POST: its link opens its service's description instead.
    methods = "".join(f'<li><a href="/protobufs/{html.escape(s)}">{html.escape(s)}</a>/{html.escape(m)} '
                      f'(POST /{html.escape(s)}/{html.escape(m)})</li>'
                      for s, ms in server.registry.services.items() for m in ms)
    return _reply(_page("aiobrpc server", f"<ul>{links}</ul><h2>Services</h2><ul>{methods}</ul>"), _HTML)


def _health(req: Request) -> HttpReply:
    return _reply("OK")


def _png(width: int, height: int, rgba: bytes) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\0" + rgba * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


@functools.cache  # made on the first request, not at import
def _favicon_png() -> bytes:
    return _png(16, 16, b"\x4c\x72\xb0\xff")  # a blue square: a browser asks for it on every page


def _favicon(req: Request) -> HttpReply:
    return HttpReply(200, [("Content-Type", "image/png"), ("Cache-Control", "max-age=86400")], _favicon_png())


def _version(req: Request) -> HttpReply:
    return _reply(version_of(req.server))


_COLUMNS = ["count", "qps", "error", "eps", "latency"] + [f"latency_{p}" for p in PERCENTILES] + \
    ["max_latency", "concurrency", "max_concurrency"]


def _status(req: Request) -> HttpReply:
    server = req.server
    summary, figures = server_summary(server), method_figures(server)
    if req.wants_json:
        return _json({**summary, "services": figures})
    if req.console:
        lines = [f"{k}: {v}" for k, v in summary.items()]
        for svc, methods in figures.items():
            lines += ["", f"[{svc}]"]
            for name, figs in methods.items():
                lines.append(name)
                lines += [f"  {k}: {v}" for k, v in figs.items()]
        return _reply("\n".join(lines) + "\n")
    head = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in summary.items())
    parts = [f'<table class="server">{head}</table>']
    for svc, methods in figures.items():
        rows = ["<tr><th>method</th>" + "".join(f"<th>{c}</th>" for c in _COLUMNS) + "</tr>"]
        plots = []
        for name, figs in methods.items():
            rows.append(f"<tr><td>{html.escape(name)}</td>"
                        + "".join(f"<td>{figs.get(c, '')}</td>" for c in _COLUMNS) + "</tr>")
            var = f"rpc_server_{server.port}_{underscored(svc + '.' + name)}_latency"
            plots.append(f"<h3>{html.escape(name)}</h3>" + _plots(server, var, f"{name} latency (us)"))
        parts.append(f'<h2>{html.escape(svc)}</h2><table class="service" data-service="{html.escape(svc)}">'
                     + "".join(rows) + "</table>" + "".join(plots))
    return _reply(_page("status", "\n".join(parts)), _HTML)


def _globs(req: Request) -> GlobList | HttpReply:
    """The page's patterns, or 400 naming the bound a peer's pattern is past."""
    try:
        return GlobList(req.path)
    except GlobError as e:
        return _reply(f"{e}\n", status=400)


def _vars(req: Request) -> HttpReply:
    globs = _globs(req)
    if isinstance(globs, HttpReply):
        return globs
    server = req.server
    found = [(n, v) for n, v in variables(server) if globs.matches(n)]
    one = found[0][0] if len(found) == 1 and found[0][0] == req.path else None  # /vars/<a name>
    if req.wants_json:
        if one is not None and "series" in req.query:
            s = server.series.get(one) if server.series is not None else None
            return _json({"name": one, "value": found[0][1], "seconds": list(s.seconds) if s else [],
                          "minutes": list(s.minutes) if s else []})
        return _json(dict(found))
    if req.console:
        return _reply("".join(f"{n} : {v}\n" for n, v in found))
    if one is not None:
        return _reply(_page(one, f"<p>{html.escape(one)} : {html.escape(str(found[0][1]))}</p>"
                                 + _plots(server, one, one)), _HTML)
    rows = "".join(f'<tr><th style="text-align:left"><a href="/vars/{urllib.parse.quote(n)}">{html.escape(n)}</a>'
                   f"</th><td>{html.escape(str(v))}</td></tr>" for n, v in found)
    return _reply(_page("vars", f"<p>Click a variable for its last 60 seconds and 60 minutes.</p>"
                                f'<table class="vars">{rows}</table>'), _HTML)


def prometheus_text(server) -> str:
    """Every numeric variable as a Prometheus gauge; each method's latencies as a summary."""
    prefix = f"rpc_server_{server.port}"
    out: list[str] = []
    for svc, methods in method_figures(server).items():
        for name, figs in methods.items():
            out += prometheus_lines(f"{prefix}_{underscored(svc + '.' + name)}", figs)
    method_vars = {f"{prefix}_{underscored(s + '.' + n)}" for s, ms in server.registry.services.items() for n in ms}
    for name, value in variables(server):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # string-valued variables are skipped, as brpc does
        if any(name.startswith(b + "_") for b in method_vars):
            continue
        out += [f"# HELP {name}", f"# TYPE {name} gauge", f"{name} {value}"]
    return "\n".join(out) + "\n"


def _metrics(req: Request) -> HttpReply:
    return _reply(prometheus_text(req.server), "text/plain; version=0.0.4")


def _flags(req: Request) -> HttpReply:
    opts = req.server.options
    rows = []
    for f in dataclasses.fields(opts):
        v = getattr(opts, f.name)
        if f.name == "auth" and v is not None:
            v = type(v).__name__
        rows.append((f.name, v))
    if req.path:
        globs = _globs(req)
        if isinstance(globs, HttpReply):
            return globs
        rows = [(n, v) for n, v in rows if globs.matches(n)]
    if req.wants_json:
        return _json({n: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v) for n, v in rows})
    return _text_or_html(req, "flags", "".join(f"{n} : {v!r}\n" for n, v in rows))


def _protobufs(req: Request) -> HttpReply:
    server = req.server
    if req.path:
        text = _describe(server, req.path)
        if text is None:
            return _reply(f"no service or message named {req.path!r} here\n", status=404)
        return _text_or_html(req, req.path, text)
    names = []
    for svc, methods in server.registry.services.items():
        names.append(svc)
        for e in methods.values():
            names += [e.request_class.DESCRIPTOR.full_name, e.response_class.DESCRIPTOR.full_name]
    return _text_or_html(req, "protobufs", "".join(f"{n}\n" for n in dict.fromkeys(names)))


def _describe(server, name: str) -> str | None:
    methods = server.registry.services.get(name)
    if methods is not None:
        listing = method_listing(methods).replace("\n", "\n  ")
        return f"service {name.rsplit('.', 1)[-1]} {{\n  {listing}\n}}\n"
    for ms in server.registry.services.values():
        for e in ms.values():
            for cls in (e.request_class, e.response_class):
                if cls.DESCRIPTOR.full_name == name:
                    from google.protobuf import descriptor_pb2
                    proto = descriptor_pb2.DescriptorProto()
                    cls.DESCRIPTOR.CopyToProto(proto)
                    return str(proto)
    return None


def _connections(req: Request) -> HttpReply:
    server = req.server
    rows = [{"remote": c.peer, "local": c.local, "protocol": c.protocol or "detecting",
             "ssl": c.tls is not None, "internal": c.internal,
             "inflight": c.inflight, "streams": len(c.streams) if c.streams else 0,
             "unwritten_bytes": c.unwritten_bytes(), "age_s": round(c.loop.time() - c.opened_at, 3)}
            for c in list(server.connections)]
    if req.wants_json:
        return _json(rows)
    cols = ["remote", "local", "protocol", "ssl", "internal", "inflight", "streams", "unwritten_bytes", "age_s"]
    lines = [" | ".join(cols)] + [" | ".join(str(r[c]) for c in cols) for r in rows]
    return _text_or_html(req, "connections", "\n".join(lines) + "\n")


_RPCZ_FIELDS = ("time", "trace_id", "span_id", "parent_span_id", "method", "peer", "latency_us", "error_code",
                "protocol")


def _rpcz(req: Request) -> HttpReply:
    server = req.server
    if server.rpcz is None:
        # 200: / links here whatever the options, and a link that opens says why it is empty.
        return _text_or_html(req, "rpcz", "rpcz is off: start the server with ServerOptions(rpcz=True)\n")
    rows = [dict(zip(_RPCZ_FIELDS, r)) for r in reversed(server.rpcz)]  # newest first
    want = req.query.get("trace_id")
    if want:
        try:
            trace_id = int(want, 16)
        except ValueError:
            return _reply(f"trace_id must be hexadecimal, got {want!r}\n", status=400)
        rows = [r for r in rows if r["trace_id"] == trace_id]
    if req.wants_json:
        return _json(rows)
    lines = []
    for r in rows:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) + f".{int(r['time'] % 1 * 1e6):06d}"
        ids = ("-" if r["trace_id"] is None else
               f"trace={r['trace_id']:016x} span={(r['span_id'] or 0):016x} parent={(r['parent_span_id'] or 0):016x}")
        lines.append(f"{stamp} {r['protocol']} {r['method']} from {r['peer']} {r['latency_us']}us "
                     f"E{r['error_code']} {ids}")
    return _text_or_html(req, "rpcz", "\n".join(lines) + "\n")


_ROUTES: dict[str, Callable[[Request], HttpReply]] = {
    "index": _index, "status": _status, "vars": _vars, "brpc_metrics": _metrics, "health": _health,
    "version": _version, "flags": _flags, "protobufs": _protobufs, "connections": _connections, "rpcz": _rpcz,
    "favicon.ico": _favicon}
