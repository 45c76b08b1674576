"""Hostile clients against a real aiobrpc server: issue 29's rows R1-R14 and the floods F1-F5.

    python bench/hostile_server.py                  # every row (about 2 minutes)
    python bench/hostile_server.py --quick          # smaller counts (about 1 minute)
    python bench/hostile_server.py --rows R1,R5 --json
    python bench/hostile_server.py --r8-calls 200000 --row-timeout 120 --rows R8

Each row gets a fresh server process (bench/hostile_rows/serve.py: aiobrpc's Server with the
row's ServerOptions, serving GrpcTestService, and a control socket the bench asks for the
server's counts), is warmed up by a normal gRPC and HTTP call, and then:

  1. the RSS of the server process is taken after gc.collect() and malloc_trim(0), and its
     peak (VmHWM) is reset (/proc/<pid>/clear_refs);
  2. the row's hostile client runs (bench/hostile_rows/rows.py, at most --row-timeout s);
     every connection it opened is then closed;
  3. for up to --settle s the bench waits until no call is running and no server socket is
     in CLOSE_WAIT; then the counts are taken, and the RSS again after gc + malloc_trim;
  4. a normal gRPC unary call and a normal HTTP/1.1 JSON call, each on a fresh connection
     (with the credential and the client certificate when the row's server asks for them);
  5. the server is stopped (Server.stop() + join(2)); one that does not exit is killed.

Columns:
  peak+     the server's peak RSS during the row (VmHWM) less its RSS before, MiB
  held+     its RSS after the row (settled) less its RSS before, MiB
            (the one marked * is compared with the row's limit, `lim`)
  refusal   from the first hostile byte to the server's refusal (RST_STREAM, GOAWAY, a 4xx,
            the connection closed; for several attempts the slowest); "never" when one did
            not come within the row's bounded wait; "-" for rows that expect no refusal
  expect    the row's own expectation (see the notes under the table for what was seen)
  normal    the normal gRPC and HTTP/1.1 calls after the row succeeded
  calls     calls still running in the server after the row (its concurrency, or handlers
            of the servicer still running, whichever is larger)
  CW        the server's sockets in CLOSE_WAIT (/proc/net/tcp[6], local port = the server's)
  conns     the server's open connections after the row (not judged: informative)
  verdict   PASS: RSS within the limit, the expectation held (a refusal where one is due),
            normal calls OK, calls 0 and CW 0; FAIL otherwise; ERROR: the row itself broke

Exit status: 0 if every row passed, 1 otherwise (or on a bad argument).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

from hostile_rows.peers import Http1, Msg, RawH2, client_tls  # noqa: E402
from hostile_rows.rows import NA, ROWS, Ctx, Outcome, describe_rows  # noqa: E402

SERVE = BENCH / "hostile_rows" / "serve.py"
SECRET = b"secret"


# -- the server's process ---------------------------------------------------------------------------
def read_status(pid: int) -> dict:
    """VmRSS and VmHWM of `pid`, KiB."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


def reset_peak(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def close_wait(port: int) -> int:
    """Sockets whose local port is `port` in state CLOSE_WAIT (08)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if len(fields) > 3 and fields[3] == "08" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        n += 1
        except (OSError, StopIteration):
            pass
    return n


class PeakSampler:
    """RSS sampled every 20 ms in a thread: the peak when clear_refs is not allowed."""

    def __init__(self, pid: int) -> None:
        import threading
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, read_status(self.pid).get("VmRSS", 0))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(1)
        return self.peak


class RowRunner:
    """One server process for one row, and its control socket."""

    def __init__(self, config: dict, tls: dict | None, log_path: Path, r8_calls: int | None,
                 server_root: str = "") -> None:
        self.config, self.tls, self.log_path, self.r8_calls = config, tls, log_path, r8_calls
        self.server_root = server_root
        self.package = ""
        self.credential = SECRET if config.get("auth") else None
        self.proc: asyncio.subprocess.Process | None = None
        self.port = self.control_port = 0
        self._ctl: tuple | None = None
        self._lock = asyncio.Lock()
        self.unresponsive = False

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    async def start(self) -> None:
        cfg = dict(self.config)
        if cfg.get("tls"):
            cfg["tls"] = {"cert": self.tls["server"], "ca": self.tls["ca"]}
        self._log = open(self.log_path, "wb")
        env = dict(os.environ)
        if self.server_root:
            env["HOSTILE_SERVER_ROOT"] = self.server_root
        self.proc = await asyncio.create_subprocess_exec(sys.executable, str(SERVE), json.dumps(cfg), cwd=str(ROOT),
                                                         stdout=subprocess.PIPE, stderr=self._log,
                                                         stdin=subprocess.DEVNULL, env=env)
        line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        if not line.startswith(b"READY"):
            raise RuntimeError(f"the server process said {line!r}: {self.log_tail(5)}")
        _, port, ctl, self.package = line.decode().strip().split(maxsplit=3)
        self.port, self.control_port = int(port), int(ctl)

    async def command(self, cmd: str, timeout: float = 3.0) -> dict:
        if self.unresponsive:
            timeout = min(timeout, 1.0)  # it did not answer once: do not wait long again
        async with self._lock:
            try:
                if self._ctl is None:
                    self._ctl = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.control_port), timeout)
                reader, writer = self._ctl
                writer.write(cmd.encode() + b"\n")
                line = await asyncio.wait_for(reader.readline(), timeout)
                if not line:
                    raise ConnectionError("the control socket closed")
                return json.loads(line)
            except (asyncio.TimeoutError, ConnectionError, OSError, ValueError) as e:
                if self._ctl is not None:
                    self._ctl[1].close()
                    self._ctl = None
                self.unresponsive = True
                raise ControlError(f"{cmd}: {type(e).__name__} {e}".strip()) from None

    async def stop(self) -> str:
        """'' when the server stopped cleanly, else what happened."""
        if self.proc is None:
            return ""
        why = ""
        if self.proc.returncode is not None:
            self._log.close()
            return "" if self.proc.returncode in (0, -9) else \
                f"the process had ended (exit status {self.proc.returncode})"
        try:
            reply = await self.command("stop", timeout=6)
            if reply.get("connections") or reply.get("concurrency") or reply.get("handlers_running"):
                why = f"after stop+join(2): {reply}"
            await asyncio.wait_for(self.proc.wait(), 5)
        except (ControlError, asyncio.TimeoutError) as e:
            if self.proc.returncode is not None:
                return f"the process had ended (exit status {self.proc.returncode})"
            why = f"no clean stop ({e or 'timeout'}); killed"
            self.proc.kill()
            await self.proc.wait()
        if self.proc.returncode not in (0, None) and not why:
            why = f"exit status {self.proc.returncode}"
        if self._ctl is not None:
            self._ctl[1].close()
        self._log.close()
        return why

    def log_tail(self, n: int = 5) -> list[str]:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line[:300] for line in lines[-n:]]

    def log_errors(self) -> list[str]:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line[:300] for line in lines if " ERROR " in line or line.startswith("Traceback")
                or " CRITICAL " in line]


class ControlError(Exception):
    pass


# -- normal calls -------------------------------------------------------------------------------------
async def normal_calls(port: int, tls: dict | None, credential: bytes | None, timeout: float = 3.0) -> tuple[bool, str]:
    """A gRPC unary call and an HTTP/1.1 JSON call, each on a fresh connection."""
    problems = []
    peer = None
    try:
        peer = await RawH2.connect("127.0.0.1", port, tls=client_tls(tls, "h2"))
        sid = peer.start_call(Msg(text="normal").SerializeToString(), auth=credential)
        await peer.wait(lambda: peer.streams[sid].ended or peer.streams[sid].rst is not None, timeout)
        s = peer.streams[sid]
        texts = [Msg.FromString(m).text for m in s.messages()]
        if s.grpc_status != 0 or texts != ["normal"]:
            problems.append(f"gRPC: grpc-status {s.grpc_status} {s.grpc_message[:60]!r} rst {s.rst} "
                            f"{peer.describe()}")
    except Exception as e:  # noqa: BLE001
        problems.append(f"gRPC: {type(e).__name__} {e}")
    finally:
        if peer is not None:
            peer.close()
    conn = None
    try:
        conn = await Http1.connect("127.0.0.1", port, tls=client_tls(tls, "http/1.1"))
        headers = [("Content-Type", "application/json")]
        if credential is not None:
            headers.append(("Authorization", credential.decode()))
        r = await conn.request("POST", "/aiobrpc.test.GrpcTestService/Unary", headers, b'{"text": "normal"}',
                               timeout=timeout)
        if r.status != 200 or json.loads(r.body or b"{}").get("text") != "normal":
            problems.append(f"HTTP: {r.status or r.why} {r.body[:80]!r}")
    except Exception as e:  # noqa: BLE001
        problems.append(f"HTTP: {type(e).__name__} {e}")
    finally:
        if conn is not None:
            conn.close()
    return not problems, "; ".join(problems) or "ok"


# -- certificates (R2) ---------------------------------------------------------------------------------
def make_pki(d: Path) -> dict:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, as files."""
    try:
        import trustme
    except ImportError:
        return _make_pki_openssl(d)
    ca = trustme.CA()
    files = {"ca": d / "ca.pem", "server": d / "server.pem", "client": d / "client.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(str(files["server"]))
    ca.issue_cert("client@example").private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    return {k: str(v) for k, v in files.items()}


def _make_pki_openssl(d: Path) -> dict:
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=bench-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, subj in (("server", "/CN=127.0.0.1"), ("client", "/CN=client")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", subj, "-keyout", f"{name}.key", "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-out", f"{name}.crt", *(["-extfile", "san.cnf"] if name == "server" else []))
        (d / f"{name}.pem").write_text((d / f"{name}.key").read_text() + (d / f"{name}.crt").read_text())
    return {"ca": str(d / "ca.pem"), "server": str(d / "server.pem"), "client": str(d / "client.pem")}


# -- one row ----------------------------------------------------------------------------------------------
def _calls(stats: dict | None) -> int | None:
    if not stats:
        return None
    return max(stats.get("concurrency", 0), stats.get("handlers_running", 0))


async def run_row(row, args, tmp: Path, pki: dict | None) -> dict:
    res = {"row": row.name, "title": row.title, "server_options": row.server, "rss_measure": row.rss_measure,
           "rss_limit_mib": row.rss_limit_mib, "error": None}
    config = dict(row.server)
    config["loop"] = args.loop
    logs = Path(args.logs) if args.logs else tmp
    runner = RowRunner(config, pki if config.get("tls") else None, logs / f"{row.name}.log", args.r8_calls,
                       os.path.abspath(args.server_root) if args.server_root else "")
    t_row = time.monotonic()
    try:
        await runner.start()
    except Exception as e:  # noqa: BLE001
        res["error"] = f"the server did not start: {type(e).__name__}: {e}"
        if runner.proc is not None and runner.proc.returncode is None:
            runner.proc.kill()
        return res
    res["server_package"] = runner.package
    sampler = None
    ctx = None
    capped: list = []
    try:
        warm_ok, warm_text = await normal_calls(runner.port, runner.tls, runner.credential)
        if not warm_ok:
            res["warmup"] = warm_text
        before = await runner.command("settle")
        rss_before = before["rss_kib"]
        if not reset_peak(runner.pid):
            sampler = PeakSampler(runner.pid)
        await runner.command("lag")
        ctx = Ctx(runner, args.quick, time.monotonic() + args.row_timeout)
        outcome: Outcome | None = None
        row_task = asyncio.ensure_future(row.fn(ctx))

        async def watch() -> None:  # the machine's memory is protected: a row past --rss-cap is stopped
            while not row_task.done():
                grown = read_status(runner.pid).get("VmRSS", 0) - rss_before
                if grown > args.rss_cap * 1024:
                    capped.append(grown)
                    runner.proc.kill()  # at once: it may grow by a GiB a second
                    row_task.cancel()
                    await runner.proc.wait()
                    return
                await asyncio.sleep(0.05)
        watcher = asyncio.ensure_future(watch())
        try:
            outcome = await asyncio.wait_for(row_task, args.row_timeout)
        except asyncio.CancelledError:
            if not capped:
                raise
            outcome = Outcome(NA, False, f"stopped early: the server's RSS grew by {capped[0] / 1024:.0f} MiB, "
                                         f"past --rss-cap={args.rss_cap:.0f} MiB, and the server was killed")
            runner.unresponsive = True
        except asyncio.TimeoutError:
            res["error"] = f"the row did not end within --row-timeout={args.row_timeout} s"
        except ControlError as e:  # the server, not the bench: measured, so a FAIL
            outcome = Outcome(NA, False, f"the server did not answer its control socket ({e}): "
                                         f"its event loop is stalled, or the process is gone")
        except Exception as e:  # noqa: BLE001 - a row that breaks is reported, the run goes on
            res["error"] = f"{type(e).__name__}: {e}"
            res["traceback"] = traceback.format_exc(limit=6)
        finally:
            if capped:
                await asyncio.wait([watcher], timeout=5)
            watcher.cancel()
        peak_kib = sampler.peak if sampler is not None else read_status(runner.pid).get("VmHWM", 0)
        if capped:
            peak_kib = max(peak_kib, rss_before + capped[0])
        ctx.close_all()
        # settle: every call ended, every socket closed by the server
        end = time.monotonic() + (0 if capped else args.settle)
        stats, cw = None, None
        while not capped:
            try:
                stats = await runner.command("stats")
            except ControlError as e:
                res["control"] = str(e)
                stats = None
            cw = close_wait(runner.port)
            if (stats is not None and _calls(stats) == 0 and cw == 0 and stats.get("connections") == 0) \
                    or time.monotonic() >= end:
                break
            await asyncio.sleep(0.1)
        try:
            after = None if capped else await runner.command("settle")
        except ControlError as e:
            after = stats
            res["control"] = str(e)
        if not capped:
            peak_kib = max(peak_kib, sampler.stop() if sampler is not None else read_status(runner.pid).get("VmHWM", 0))
        res["rss_before_mib"] = round(rss_before / 1024, 1)
        res["peak_growth_mib"] = round(max(0, peak_kib - rss_before) / 1024, 1)
        res["held_growth_mib"] = round(((after or {}).get("rss_kib", rss_before) - rss_before) / 1024, 1) \
            if after else None
        res["calls"] = _calls(stats)
        res["close_wait"] = cw
        res["connections"] = stats.get("connections") if stats else None
        res["server_tasks"] = stats.get("tasks") if stats else None
        if capped:
            cw = close_wait(runner.port)
            res["close_wait"] = cw
            res["normal_ok"], res["normal"] = False, "not tried: the server was killed at --rss-cap"
        else:
            res["normal_ok"], res["normal"] = await normal_calls(runner.port, runner.tls, runner.credential)
        if outcome is not None:
            res["refusal_s"] = outcome.refusal_s if outcome.refusal_s == NA or outcome.refusal_s is None \
                else round(outcome.refusal_s, 4)
            res["expect_ok"] = outcome.expect_ok
            res["note"] = outcome.note
        if ctx.notes:
            res["note"] = (res.get("note", "") + "; " + "; ".join(ctx.notes)).strip("; ")
    except Exception as e:  # noqa: BLE001 - the bench's own trouble (the server stalled, died...)
        res["error"] = res["error"] or f"{type(e).__name__}: {e}"
        res.setdefault("traceback", traceback.format_exc(limit=6))
    finally:
        if ctx is not None:
            ctx.close_all()
        if sampler is not None:
            sampler.stop()
        if runner.proc is not None and runner.proc.returncode not in (None, 0) and not capped:
            res["server_died"] = f"exit status {runner.proc.returncode}"
        res["stop"] = await runner.stop()
        res["server_log_errors"] = runner.log_errors()[:5]
        res["server_log_tail"] = runner.log_tail(4)
        res["seconds"] = round(time.monotonic() - t_row, 1)
    res["verdict"] = verdict(res, row)
    return res


def verdict(res: dict, row) -> str:
    if res.get("error") or "expect_ok" not in res:
        return "ERROR"
    growth = res.get("peak_growth_mib" if row.rss_measure == "peak" else "held_growth_mib")
    ok = (growth is not None and growth <= row.rss_limit_mib and res["expect_ok"] and res.get("normal_ok")
          and res.get("calls") == 0 and res.get("close_wait") == 0)
    return "PASS" if ok else "FAIL"


# -- output ------------------------------------------------------------------------------------------------
def fmt_refusal(v) -> str:
    if v == NA:
        return "-"
    if v is None:
        return "never"
    return f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"


def print_table(results: list[dict], rows_by_name: dict) -> None:
    head = f"{'row':<4} {'what':<38} {'peak+':>7} {'held+':>7} {'lim':>4} {'refusal':>9} {'expect':>6} " \
           f"{'normal':>6} {'calls':>5} {'CW':>3} {'conns':>5}  verdict"
    print(head)
    print("-" * len(head))
    for r in results:
        row = rows_by_name[r["row"]]

        def mib(key):
            v = r.get(key)
            mark = "*" if key.startswith(row.rss_measure) else " "
            return f"{'?' if v is None else f'{v:.1f}'}{mark}"

        def val(v, yes="ok", no="FAIL"):
            return "?" if v is None else (yes if v else no)
        print(f"{r['row']:<4} {r['title'][:38]:<38} {mib('peak_growth_mib'):>7} {mib('held_growth_mib'):>7} "
              f"{row.rss_limit_mib:>4.0f} {fmt_refusal(r.get('refusal_s', NA)) if 'expect_ok' in r else '?':>9} "
              f"{val(r.get('expect_ok')):>6} {val(r.get('normal_ok')):>6} "
              f"{'?' if r.get('calls') is None else r['calls']:>5} "
              f"{'?' if r.get('close_wait') is None else r['close_wait']:>3} "
              f"{'?' if r.get('connections') is None else r['connections']:>5}  {r['verdict']}")
    print()
    print("Notes (what each row saw):")
    for r in results:
        lines = []
        if r.get("error"):
            lines.append(f"error: {r['error']}")
        if r.get("note"):
            lines.append(r["note"])
        if r.get("normal") and r.get("normal") != "ok":
            lines.append(f"normal calls after the row: {r['normal']}")
        if r.get("warmup"):
            lines.append(f"warm-up calls before the row: {r['warmup']}")
        if r.get("stop"):
            lines.append(f"server stop: {r['stop']}")
        if r.get("server_died"):
            lines.append(f"server process: {r['server_died']}")
        if r.get("control"):
            lines.append(f"control socket: {r['control']}")
        if r.get("server_log_errors"):
            lines.append("server logged: " + " | ".join(r["server_log_errors"][:2]))
        text = " / ".join(lines) or "-"
        print(textwrap.fill(text, 110, initial_indent=f"  {r['row']:<4} ", subsequent_indent=" " * 7))


# -- main ---------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Hostile clients against an aiobrpc server (issue 29's rows).",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="rows:\n" + describe_rows())
    ap.add_argument("--rows", default="", help="rows to run, e.g. R1,R5,F3 (default: all)")
    ap.add_argument("--quick", action="store_true", help="smaller counts: fewer requests, rounds, streams")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--row-timeout", type=float, default=20.0, help="seconds a row's hostile client may take")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds to wait after a row for calls to end and CLOSE_WAIT sockets to close")
    ap.add_argument("--r8-calls", type=int, default=None, help="R8's call count (default 20000, --quick 3000)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="the server's event loop")
    ap.add_argument("--logs", default="", help="keep each row's server log (stderr) in this folder as ROW.log")
    ap.add_argument("--rss-cap", type=float, default=1024.0,
                    help="MiB of server RSS growth at which a row is stopped (the machine is protected)")
    ap.add_argument("--server-root", default="",
                    help="serve the aiobrpc package found in this folder (e.g. an unpacked `git archive HEAD`) "
                         "instead of this checkout's")
    ap.add_argument("--list", action="store_true", help="list the rows and exit")
    args = ap.parse_args(argv)
    return args


async def main_async(args, selected) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="hostile_server.") as tmp:
        tmp = Path(tmp)
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
        pki = None
        if any(r.server.get("tls") for r in selected):
            (tmp / "pki").mkdir()
            pki = make_pki(tmp / "pki")
        for row in selected:
            if not args.json:
                print(f"  running {row.name}: {row.title} ...", file=sys.stderr, flush=True)
            results.append(await run_row(row, args, tmp, pki))
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print(describe_rows())
        return 0
    by_name = {r.name: r for r in ROWS}
    names = [n.strip().upper() for n in args.rows.split(",") if n.strip()] or list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        print(f"unknown rows {unknown}; rows are {', '.join(by_name)}", file=sys.stderr)
        return 2
    selected = [by_name[n] for n in names]
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__)] + sys.argv[1:])
    if not args.json:
        print(__doc__.split("\nColumns:")[0].splitlines()[0])
        print(f"command: {command}")
        print(f"server package: {os.path.abspath(args.server_root or ROOT)}/aiobrpc")
        print(f"python {sys.version.split()[0]}, server loop {args.loop}, row timeout {args.row_timeout:.0f} s, "
              f"settle {args.settle:.0f} s{', quick' if args.quick else ''}")
        print("Columns:" + __doc__.split("\nColumns:")[1].split("\nExit status")[0])
    t0 = time.monotonic()
    results = asyncio.run(main_async(args, selected))
    failed = [r["row"] for r in results if r["verdict"] != "PASS"]
    if args.json:
        print(json.dumps({"command": command, "quick": args.quick, "loop": args.loop,
                          "seconds": round(time.monotonic() - t0, 1), "rows": results,
                          "failed": failed}, indent=1, default=str))
    else:
        print_table(results, by_name)
        print()
        print(f"{len(results) - len(failed)} of {len(results)} rows passed in {time.monotonic() - t0:.0f} s"
              + (f"; not passed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
