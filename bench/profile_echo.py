"""Profile one scenario of bench/echo.py: py-spy on the server and client processes at once.

    python bench/profile_echo.py                          # aiobrpc compiled, 16 B at c=128
    python bench/profile_echo.py --impl d --scenario "16B c=1" --seconds 6
    python bench/profile_echo.py --native                 # Cython and C frames too

Needs `pip install py-spy` and permission to ptrace the children (a container may need
--cap-add SYS_PTRACE). The processes run as in echo.py, except that the client is pinned to
CPU 0 and the server to CPU 1 (--no-pin to leave them to the scheduler: then a woken peer often
runs on the writer's CPU and its writev() looks long to a wall-clock sampler); py-spy samples each for
`--seconds` after a 1 s warm-up, and this prints, per process, the functions and the lines
with the most samples on top of the stack (self time; py-spy cuts coroutine stacks at the
task step, so inclusive times would be partial and are left out). The raw collapsed
stacks are kept in bench/results/profile-<impl>-<role>.txt for a flame graph
(flamegraph.pl or speedscope.app read them).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import echo

RESULTS = echo.RESULTS


def top_functions(path: Path, limit: int) -> tuple[int, list, list]:
    """(samples, [(self count, function)], [(self count, function:line)]) of a py-spy raw file."""
    own: collections.Counter = collections.Counter()
    lines: collections.Counter = collections.Counter()
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        samples += n
        leaf = stack.rpartition(";")[2]
        own[_short(leaf)] += n
        lines[_short(leaf, with_line=True)] += n
    return samples, own.most_common(limit), lines.most_common(limit)


def _short(frame: str, with_line: bool = False) -> str:
    # py-spy raw frames look like "function (path/to/file.py:123)"; keep function and file.
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    file, _, lineno = where.rpartition(":")
    parts = Path(file).parts
    short = "/".join(parts[-2:]) if parts else where
    return f"{name} ({short}:{lineno})" if with_line else f"{name} ({short})"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="a", choices=sorted(echo.IMPLS))
    p.add_argument("--scenario", default="16B c=128", choices=[s[0] for s in echo.SCENARIOS])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--native", action="store_true", help="sample native (Cython, C) frames too")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-pin", action="store_true", help="let the scheduler place the processes")
    args = p.parse_args(argv)
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")

    grpc_dir = echo.compile_grpc_proto() if args.impl == "c" else None
    env = echo.impl_env(args.impl, grpc_dir)
    # Client on CPU 0, server on CPU 1: on a 2-core VM the woken peer otherwise often runs on
    # the writer's CPU and the writer's writev() looks long to a wall-clock sampler.
    server, port, detail = echo.start_server(args.impl, args.loop, env, None if args.no_pin else 1)
    RESULTS.mkdir(exist_ok=True)
    try:
        client = subprocess.Popen(
            [sys.executable, str(echo.BENCH / "echo.py"), "--role", "client", "--impl", args.impl,
             "--loop", args.loop, "--port", str(port), "--server-pid", str(server.pid),
             "--scenarios", args.scenario, "--warmup", "1", "--duration", str(args.seconds + 1.5)],
            stdout=subprocess.PIPE, env=env, text=True, cwd=echo.ROOT,
            preexec_fn=echo._pinned(None if args.no_pin else 0))
        time.sleep(1.5)
        spies = {}
        for role, pid in (("server", server.pid), ("client", client.pid)):
            out = RESULTS / f"profile-{args.impl}-{role}.txt"
            cmd = [pyspy, "record", "--pid", str(pid), "--duration", str(int(args.seconds)),
                   "--rate", str(args.rate), "--format", "raw", "--output", str(out)]
            out.unlink(missing_ok=True)
            # --native needs to stop the process for each sample; without it py-spy reads
            # the stacks while the process runs.
            cmd.append("--native" if args.native else "--nonblocking")
            spies[role] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                            text=True), out)
        for role, (spy, _) in spies.items():
            if spy.wait() != 0:
                print(f"py-spy on the {role} failed: {spy.stderr.read().strip()}", file=sys.stderr)
        for line in client.stdout:
            row = echo.json.loads(line)
            print(f"{args.impl} {detail} {args.scenario}: {row['qps']:,.0f} QPS while sampled "
                  f"(py-spy slows the processes it samples), client {row['client_cpu_us_per_call']:.1f} us "
                  f"and server {row['server_cpu_us_per_call']:.1f} us CPU per call")
        client.wait()
    finally:
        echo.stop_server(server)
    for role, (_, out) in spies.items():
        if not out.exists():
            continue
        samples, own, lines = top_functions(out, args.top)
        print(f"\n== {role}: {samples} samples ({out}) ==")
        print("self %  function   (self: on top of the Python stack, C code it calls included)")
        for fn, n in own:
            print(f"{100 * n / samples:6.1f}  {fn}")
        # Totals are left out: py-spy cuts a coroutine's stack at the task step that resumed it.
        print(f"\n-- {role}: hottest lines --")
        for fn, n in lines:
            print(f"{100 * n / samples:6.1f}  {fn}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
