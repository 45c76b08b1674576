"""The hot path: the kernels of the call path (receive buffer and send chain, frame reader,
meta codec).

`iobuf` and `framing` are one source each, compiled in place like the modules of
aiobrpc/_compiled.py: compiled or Python is chosen once per process (Python where they are not
built or AIOBRPC_NO_EXTENSIONS=1 is set). `meta` is still a Cython kernel with a pure-Python
twin of identical API, used compiled unless missing or AIOBRPC_NO_EXTENSIONS=1 is set; other
layers look names up on this module at call time (`_fast.RpcMeta(...)`), so `use("python")`
switches it (the benches compare the twins so). Type checkers see the Python sources.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._compiled import pure_requested
from . import framing, iobuf, meta_py

_EXPORTS = {
    "framing": ("FrameReader", "parse_header", "pack_header", "magic_prefix_ok", "split_payload",
                "KIND_PRPC", "KIND_STRM", "DEFAULT_MAX_BODY_SIZE", "ATTACHMENT_PIN_RATIO"),
    "iobuf": ("IOBuf", "ReadBuffer", "byte_view", "HEADER_SIZE", "LargeBufferCache", "large_buffers"),
    "meta": ("RpcMeta", "encode_meta", "decode_meta", "pack_head", "MAX_USER_FIELDS"),
}

if TYPE_CHECKING:
    from .framing import (ATTACHMENT_PIN_RATIO, DEFAULT_MAX_BODY_SIZE, KIND_PRPC, KIND_STRM,
                             FrameReader, magic_prefix_ok, pack_header, parse_header,
                             split_payload)
    from .iobuf import HEADER_SIZE, IOBuf, LargeBufferCache, ReadBuffer, byte_view, large_buffers
    from .meta_py import MAX_USER_FIELDS, RpcMeta, decode_meta, encode_meta, pack_head


def _compiled():
    try:
        from . import meta  # type: ignore[attr-defined]
    except ImportError:
        return None
    return {"framing": framing, "iobuf": iobuf, "meta": meta}


_PURE = {"framing": framing, "iobuf": iobuf, "meta": meta_py}
_COMPILED = None if pure_requested() else _compiled()

IMPLEMENTATION = "python"


def available() -> list[str]:
    """Implementations that can be selected here: always "python", "cython" when built."""
    return ["cython", "python"] if _COMPILED is not None else ["python"]


def use(name: str) -> None:
    """Select "cython" or "python" for every layer of aiobrpc (tests use this)."""
    global IMPLEMENTATION
    if name == "cython":
        if _COMPILED is None:
            raise ImportError("aiobrpc._fast extensions are not built (or AIOBRPC_NO_EXTENSIONS is set)")
        modules = _COMPILED
    elif name == "python":
        modules = _PURE
    else:
        raise ValueError(f"implementation must be 'cython' or 'python', got {name!r}")
    g = globals()
    for mod, names in _EXPORTS.items():
        for n in names:
            g[n] = getattr(modules[mod], n)
    IMPLEMENTATION = name


use("cython" if _COMPILED is not None else "python")
