"""Run a Python scenario inside a fresh network namespace, with nftables rules on its loopback.

Packet-level faults (docs/hostile_inputs.md E6-E8) need a kernel that drops or resets packets: nft in
a private namespace does that without touching the host (`tc netem` has no kernel module here).
`run_in_netns` starts `unshare --net` with this interpreter, brings `lo` up, loads the rules,
then runs `script` with the repository on sys.path. The script prints one JSON object as its
last line of stdout, which is returned. Inside, `nft(rules)` from this module changes the rules
mid-scenario. Ports are the namespace's own, so fixed ports are fine there.

>>> run_in_netns('import json; print(json.dumps({"ok": 1}))',  # doctest: +SKIP
...              "table inet f { chain out { type filter hook output priority 0; tcp dport 9999 drop; }; }")
{'ok': 1}
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# argv: [rules, script]. Runs inside the namespace, before and around the caller's script.
_BOOTSTRAP = """
import subprocess, sys
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
if sys.argv[1]:
    subprocess.run(["nft", "-f", "-"], input=sys.argv[1], text=True, check=True)
script = sys.argv[2]
sys.argv = ["<netns script>"]
exec(compile(script, "<netns script>", "exec"), {"__name__": "__main__"})
"""


class NetnsError(RuntimeError):
    """The namespace could not be made, or the script failed or printed no JSON."""


def nft(rules: str) -> None:
    """Load nft `rules` (the `nft -f` syntax) into the current namespace."""
    proc = subprocess.run(["nft", "-f", "-"], input=rules, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise NetnsError(f"nft -f failed ({proc.returncode}): {proc.stderr.strip()}\nrules:\n{rules}")


def run_in_netns(script: str, nft_rules: str | None = None, timeout: float = 60.0,
                 env: dict[str, str] | None = None) -> dict:
    """Run `script` in a new network namespace after loading `nft_rules`; return its JSON result."""
    run_env = dict(os.environ)
    run_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, run_env.get("PYTHONPATH")) if p)
    run_env.update(env or {})
    cmd = ["unshare", "--net", "--", sys.executable, "-c", _BOOTSTRAP, nft_rules or "", script]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env,
                              cwd=REPO_ROOT, check=False)
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"netns script did not finish within {timeout} s\n"
                         f"stdout:\n{_text(e.stdout)}\nstderr:\n{_text(e.stderr)}") from None
    if proc.returncode:
        raise NetnsError(f"netns script failed with exit status {proc.returncode}\n"
                         f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        raise NetnsError(f"netns script printed no JSON on its last line\n"
                         f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}") from None


@functools.lru_cache(maxsize=1)
def netns_available() -> str | None:
    """None when unshare, ip and nft work here; else why not."""
    missing = [tool for tool in ("unshare", "ip", "nft") if shutil.which(tool) is None]
    if missing:
        return (f"missing {', '.join(missing)} (Debian: apt-get install nftables iproute2 util-linux)")
    probe = ("ip link set lo up && printf 'table inet probe {\\n chain out {\\n"
             "  type filter hook output priority 0; policy accept;\\n }\\n}\\n' | nft -f -")
    try:
        proc = subprocess.run(["unshare", "--net", "--", "sh", "-c", probe],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --net failed: {e}"
    if proc.returncode:
        return f"unshare --net with ip and nft failed ({proc.returncode}): {proc.stderr.strip()}"
    return None


def _text(data) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""
