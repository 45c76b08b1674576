"""Harness: the naming-service parsers (client/naming/): list:// urls, file:// contents (the
file's bytes, read by FileNamingService._read from a temporary file), etcd values
(etcd_member.parse_member, and _Members.put as the etcd watcher applies them), entries
(base.parse_entry / split_entry), and naming urls (create_naming_service for list://).

Input: byte 0 picks the parser, the rest is the text.

Expected: the servers, or ValueError (TypeError nowhere: the input is always str/bytes); the
servers are each a valid ServerNode whose address parses back to itself. Anything else is a
finding.

    python -m fuzz.naming fuzz/corpus/naming -max_total_time=60
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile

from fuzz import _harness as H

with H.instrumented():
    from aiobrpc.client.naming import base, etcd, etcd_member, file, list as list_ns

_tmp = None


def _path() -> str:
    global _tmp
    if _tmp is None:
        fd, _tmp = tempfile.mkstemp(prefix="aiobrpc-fuzz-naming-")
        os.close(fd)
        atexit.register(_remove, _tmp)
    return _tmp


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _check(nodes) -> str:
    for n in nodes:
        back = base.parse_entry(n.address if not n.tag else f"{n.address} {n.tag}")
        if (back.host, back.port) != (n.host, n.port):
            raise H.Finding(f"{n!r} does not parse back from its address {n.address!r}: {back!r}")
    return ",".join(str(n) for n in nodes)


def one_input(data: bytes) -> str:
    return H.plain(_one, data)


def _one(data: bytes) -> str:
    if not data:
        return "empty"
    which = data[0] % 5
    raw = data[1:]
    text = raw.decode("utf-8", "replace")
    try:
        if which == 0:
            nodes = list_ns.ListNamingService("list://" + text).servers
        elif which == 1:
            with open(_path(), "wb") as f:
                f.write(raw)
            nodes = file.FileNamingService(_path())._read()
        elif which == 2:
            nodes = [etcd_member.parse_member(raw)]
        elif which == 3:
            if base.split_entry(text) is None:
                return "entry skipped"
            nodes = [base.parse_entry(text)]
        else:
            members = etcd._Members("etcd://fuzz/x")
            for i, part in enumerate(raw.split(b"\n")[:64]):
                if part.startswith(b"-"):
                    members.delete(part[1:9])
                else:
                    members.put(part[:8], part[8:])
            nodes = members.listed()
    except ValueError as e:
        return f"{which} refused"
    except etcd._ReadAgain:
        return f"{which} read again"
    return f"{which} {H.short(_check(nodes).encode())}"


if __name__ == "__main__":
    H.fuzz_main(one_input)
