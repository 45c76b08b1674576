"""The hot path: the kernels of the call path (receive buffer and send chain, frame reader,
meta codec), and the parameter server's SGD step (`sgd`, imported by its optimizer only).

Each is one source, compiled in place like the other modules of aiobrpc/_compiled.py: compiled
or Python is chosen once per process (Python where they are not built or
AIOBRPC_NO_EXTENSIONS=1 is set); `_compiled.load_source` gives a module's Python build beside
the compiled one, for differential tests and fuzzing. Other layers look names up on this
module (`_fast.RpcMeta(...)`). Type checkers see the Python sources.
"""

from __future__ import annotations

import importlib.machinery

from . import framing, iobuf, meta
from .framing import (ATTACHMENT_PIN_RATIO, DEFAULT_MAX_BODY_SIZE, KIND_PRPC, KIND_STRM,
                      FrameReader, magic_prefix_ok, pack_header, parse_header, split_payload)
from .iobuf import HEADER_SIZE, IOBuf, LargeBufferCache, ReadBuffer, byte_view, large_buffers
from .meta import MAX_USER_FIELDS, RpcMeta, decode_meta, encode_meta, pack_head

__all__ = ["ATTACHMENT_PIN_RATIO", "DEFAULT_MAX_BODY_SIZE", "KIND_PRPC", "KIND_STRM",
           "FrameReader", "magic_prefix_ok", "pack_header", "parse_header", "split_payload",
           "HEADER_SIZE", "IOBuf", "LargeBufferCache", "ReadBuffer", "byte_view", "large_buffers",
           "MAX_USER_FIELDS", "RpcMeta", "decode_meta", "encode_meta", "pack_head",
           "IMPLEMENTATION"]

_built = [isinstance(getattr(m, "__loader__", None), importlib.machinery.ExtensionFileLoader)
          for m in (framing, iobuf, meta)]
# "cython" where the kernels are the compiled build, "python" where they run as Python
# ("mixed" only where a build was left half done).
IMPLEMENTATION = "cython" if all(_built) else "python" if not any(_built) else "mixed"
