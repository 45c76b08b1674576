"""Rebuild the seed corpus (fuzz/corpus/<harness>/): the golden captures (tests/data/golden: real
C++ brpc conversations), the rows of docs/hostile_inputs.md, and structured inputs picked from a
fixed random stream, one per distinct outcome (inputs that are findings go to
fuzz/findings/<harness>/ instead).

    python -m fuzz.make_corpus            # writes fuzz/corpus (deterministic: seeded)
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import importlib
import json
import os
import random
import struct
import zlib

ROOT = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(ROOT, "..", "tests", "data", "golden")
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def golden() -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(GOLDEN, "*.json"))):
        d = json.load(open(path))
        out[d["scenario"]] = (bytes.fromhex(d.get("c2s_hex", "")), bytes.fromhex(d.get("s2c_hex", "")))
    return out


def prpc(meta: bytes, payload: bytes = b"") -> bytes:
    return b"PRPC" + struct.pack(">II", len(meta) + len(payload), len(meta)) + meta + payload


def seeds() -> dict:
    g = golden()
    s: dict = {h: {} for h in ("baidu_server", "http_server", "h2_server", "stream", "baidu_client",
                               "grpc_client", "compress", "json_transcode", "naming", "codec")}
    for name, (c2s, s2c) in g.items():
        if c2s.startswith((b"PRPC", b"STRM")) or not c2s[:4].isalpha():
            auth = 0x10 if name.startswith("auth") else 0
            s["baidu_server"][f"golden_{name}"] = bytes([0x08 | auth]) + c2s
            s["baidu_server"][f"golden_{name}_dribble"] = bytes([0x09 | auth]) + c2s
            s["codec"][f"golden_{name}_c2s"] = b"\x00" + c2s
        else:
            s["http_server"][f"golden_{name}"] = b"\x08" + c2s
        if s2c.startswith(b"PRPC") or s2c.startswith(b"STRM"):
            s["baidu_client"][f"golden_{name}"] = b"\x00\x00" + s2c
            s["codec"][f"golden_{name}_s2c"] = b"\x06" + s2c
    # docs/hostile_inputs.md, section A (framing) and H (HTTP), H2 floods
    hs = s["baidu_server"]
    hs["A1_bad_magic"] = b"\x08XXXX" + b"\0" * 8
    hs["A2_partial_magic"] = b"\x00PR"
    hs["A3_truncated_header"] = b"\x08PRPC\0\0"
    hs["A4_huge_body"] = b"\x08PRPC\xff\xff\xff\xff\0\0\0\x10"
    hs["A4_max_plus_one"] = b"\x08PRPC" + struct.pack(">II", (1 << 20) + 1, 4)
    hs["A6_meta_gt_body"] = b"\x08PRPC" + struct.pack(">II", 4, 8) + b"\0" * 4
    hs["A7_empty_meta"] = b"\x08" + prpc(b"")
    hs["A9_bad_meta"] = b"\x08" + prpc(b"\x0a\xff\xff\xff\xff\x0f")
    hs["A8_sizes_2_31"] = b"\x08PRPC" + struct.pack(">II", 1 << 31, 1 << 31)
    hs["H1_tls_hello"] = b"\x08\x16\x03\x01\x00\x05hello"
    hs["H1_garbage"] = b"\x08\x00\x01\x02garbage"
    ht = s["http_server"]
    ht["H3_cl_and_te"] = b"\x08POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    ht["H4_two_cl"] = b"\x08POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"
    ht["H5_obs_fold"] = b"\x08GET /status HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n"
    ht["H6_chunk_sign"] = b"\x08POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\n{}\r\n0\r\n\r\n"
    ht["H7_big_head"] = b"\x08GET /status HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 90000 + b"\r\n\r\n"
    ht["H9_two_requests"] = b"\x08GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /version HTTP/1.1\r\nHost: x\r\n\r\n"
    ht["H11_traversal"] = b"\x08GET /..%2f..%2fetc/passwd HTTP/1.1\r\nHost: x\r\n\r\n"
    ht["H2_long_target"] = b"\x08GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    ht["H13_no_auth"] = b"\x18GET /status HTTP/1.1\r\nHost: x\r\n\r\n"
    ht["H14_glob"] = b"\x08GET /vars/" + b"a*" * 300 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    ht["json_echo"] = (b"\x08POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 17\r\n\r\n{\"message\":\"hi\"}\n")
    for page in ("status", "vars", "flags", "connections", "protobufs", "rpcz", "brpc_metrics", "index", "health",
                 "version", "vars/*?console=1"):
        ht[f"page_{page.replace('/', '_').replace('*', 'x').replace('?', '_').replace('=', '_')}"] = \
            b"\x08GET /" + page.encode() + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    h2 = s["h2_server"]
    settings = b"\0\0\0\x04\0\0\0\0\0"
    ping = b"\0\0\x08\x06\0\0\0\0\0" + b"\0" * 8
    h2["preface_settings"] = b"\x08" + PREFACE + settings
    h2["ping_flood"] = b"\x08" + PREFACE + settings + ping * 3000
    h2["settings_flood"] = b"\x08" + PREFACE + settings * 3000
    h2["bad_preface"] = b"\x08PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n"
    cs = s["compress"]
    for t in (1, 2, 3):
        cs[f"valid_{t}"] = bytes([0x80 | t, 20]) + b"hello hello hello hello"
    cs["gzip_bomb"] = bytes([2, 20]) + gzip.compress(b"\0" * (4 << 20), mtime=0)
    cs["zlib_bomb"] = bytes([3, 20]) + zlib.compress(b"\0" * (4 << 20))
    cs["snappy_declares_huge"] = bytes([1, 20]) + b"\xff\xff\xff\xff\x0f\x00"
    cs["gzip_trailing"] = bytes([2, 20]) + gzip.compress(b"x", mtime=0) + b"junk"
    cs["unknown_type"] = bytes([9, 20]) + b"abc"
    js = s["json_transcode"]
    for i, body in enumerate((b'{"message":"hi","sleep_ms":1}', b'{"message":1}', b'{"payload":"aGk="}', b'[]',
                              b'{"message":"x","unknown":{"a":[1,2]}}', b'{"message":"\\ud800"}', b"message: 'x'",
                              b"\x0a\x02hi", b"{" * 200 + b"}" * 200, b'{"sleep_ms":1e400}')):
        js[f"body_{i}"] = bytes([i * 16 % 256]) + body
    nm = s["naming"]
    for i, text in enumerate((b"127.0.0.1:80,10.0.0.1:8000 tag", b"[::1]:80", b"host.example:65535",
                              b"1.2.3.4:0", b"a:b:c", b"127.0.0.1:80 # comment\n10.0.0.2:81\n",
                              b'{"address":"1.2.3.4:5","weight":3}', b'{"address":"1.2.3.4:5","tag":"t"}',
                              b"k1     1.2.3.4:80\nk2     1.2.3.5:80\n-k1")):
        nm[f"entry_{i}"] = bytes([i % 5]) + text
    return s


def sampled(harness: str, n: int, keep: int, make) -> tuple[dict, dict]:
    """Up to `keep` inputs of `make(rng)` with distinct outcomes; findings apart."""
    mod = importlib.import_module(f"fuzz.{harness}")
    rng = random.Random(f"aiobrpc-fuzz-{harness}")
    out, found, seen = {}, {}, set()
    for _ in range(n):
        data = make(rng)
        try:
            key = mod.one_input(data)
        except Exception as e:  # noqa: BLE001 - a finding: kept apart
            k = str(e)[:50]
            if k not in seen:
                seen.add(k)
                found[f"{harness}-{hashlib.sha1(data).hexdigest()[:12]}"] = data
            continue
        key = key[:60]
        if key not in seen and len(out) < keep:
            seen.add(key)
            out[f"s_{hashlib.sha1(data).hexdigest()[:12]}"] = data
    return out, found


def main() -> None:
    s = seeds()
    found_all: dict = {}

    def structured(flag_mask: int, size: int):
        return lambda rng: bytes([0x20 | (rng.randrange(32) & flag_mask)]) + rng.randbytes(size)

    plans = {"baidu_server": (400, 40, structured(0x1F, 300)), "http_server": (400, 40, structured(0x1F, 300)),
             "h2_server": (400, 40, structured(0x1F, 400)), "stream": (300, 30, structured(0x1F, 300)),
             "baidu_client": (400, 40, structured(0x1F, 300)), "grpc_client": (400, 40, structured(0x0F, 300))}
    for h, (n, keep, make) in plans.items():
        got, found = sampled(h, n, keep, make)
        s[h].update(got)
        found_all.update(found)
    for h, items in s.items():
        d = os.path.join(ROOT, "corpus", h)
        os.makedirs(d, exist_ok=True)
        for name, data in items.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
    for name, data in found_all.items():
        h = name.split("-")[0]
        d = os.path.join(ROOT, "findings", h)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    print({h: len(v) for h, v in s.items()}, "findings:", sorted(found_all))


if __name__ == "__main__":
    main()
