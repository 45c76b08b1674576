"""The baidu_std protocol, sans-IO (brpc's docs/en/baidu_std.md, src/brpc/policy/baidu_rpc_protocol.cpp).

Receiving: a `Decoder` is fed bytes (by the kernel through get_buffer/buffer_updated, or by
`feed`) and yields RequestReceived / ResponseReceived / StreamFrameReceived events. A framing
or meta violation raises a fatal RemoteProtocolError: close the connection. The data is a view
of the receive buffer; so is the attachment, unless that buffer is more than 4x its size: then
it is copied, as the user may keep it (`_fast.split_payload`).

Sending: `pack(meta, data, attachment)` returns the frame as a list of buffers — one buffer
with header and meta, the data, and a zero-copy view of the caller's attachment — for one
`writelines`. `encode_data` / `decode_data` apply compression and checksums in brpc's order:
serialize → compress → checksum on the way out, verify → decompress on the way in.
"""

from __future__ import annotations

from .. import _fast
from ..errors import EREQUEST, ERESPONSE, LocalProtocolError, RemoteProtocolError
from . import checksum, compress
from .events import RequestReceived, ResponseReceived, StreamFrameReceived

MAGIC = b"PRPC"
DEFAULT_MAX_BODY_SIZE = 64 * 1024 * 1024

CONTENT_TYPE_PB = 0
CONTENT_TYPE_JSON = 1
CONTENT_TYPE_PROTO_JSON = 2
CONTENT_TYPE_PROTO_TEXT = 3
CONTENT_TYPE_NAMES = {0: "pb", 1: "json", 2: "proto-json", 3: "proto-text"}

SERVER = "server"
CLIENT = "client"
_NO_ATTACHMENT = memoryview(b"")


class Decoder:
    """Turns received bytes into events. `role` is SERVER (requests) or CLIENT (responses)."""

    __slots__ = ("_reader", "_event", "_code", "role", "_decode_meta", "_split_payload",
                 "_kind_strm", "get_buffer", "buffer_updated", "feed", "pending_bytes", "next_frame")

    def __init__(self, role: str, max_body_size: int = DEFAULT_MAX_BODY_SIZE, **buffer_options) -> None:
        if role not in (SERVER, CLIENT):
            raise LocalProtocolError(f"role must be {SERVER!r} or {CLIENT!r}, got {role!r}")
        self.role = role
        reader = self._reader = _fast.FrameReader(max_body_size, **buffer_options)
        self._event = RequestReceived if role == SERVER else ResponseReceived
        self._code = EREQUEST if role == SERVER else ERESPONSE
        # Bound once per connection: the twin selected now, and no Python frame per call for
        # what the kernel side calls most.
        self._decode_meta = _fast.decode_meta
        self._split_payload = _fast.split_payload
        self._kind_strm = _fast.KIND_STRM
        self.get_buffer = reader.get_buffer
        self.buffer_updated = reader.buffer_updated
        self.feed = reader.feed
        self.pending_bytes = reader.pending_bytes
        self.next_frame = reader.next_frame  # (kind, meta, payload) or None; see event()

    @property
    def reader(self):
        return self._reader

    def next_event(self):
        """The next complete event, or None when more bytes are needed."""
        frame = self._reader.next_frame()
        if frame is None:
            return None
        return self.event(frame)

    def event(self, frame):
        """The event of a frame that `next_frame()` returned."""
        kind, meta_view, payload = frame
        if kind == self._kind_strm:
            return StreamFrameReceived(meta_view, payload)
        meta = self._decode_meta(meta_view)
        att = meta.attachment_size
        if not att:
            return self._event(meta, payload, _NO_ATTACHMENT)
        size = len(payload)
        if att < 0 or att > size:
            what = "request_size" if self.role == SERVER else "response_size"
            err = RemoteProtocolError(f"attachment_size={att} is larger than {what}={size}",
                                      code=self._code, fatal=False)
            return self._event(meta, _NO_ATTACHMENT, _NO_ATTACHMENT, err)
        # A small attachment is copied out of the shared receive block (split_payload): the
        # user may keep it long after the call.
        data, attachment = self._split_payload(payload, att)
        return self._event(meta, data, attachment)

    def events(self) -> list:
        """Every complete event buffered so far."""
        out = []
        while True:
            ev = self.next_event()
            if ev is None:
                return out
            out.append(ev)


def pack_header(magic: bytes, body_size: int, meta_size: int) -> bytes:
    """The 12-byte header of a PRPC or STRM frame."""
    return _fast.pack_header(magic, body_size, meta_size)


def pack(meta, data, attachment=None, magic: bytes = MAGIC) -> list:
    """Frame `meta` + `data` + `attachment` as a list of buffers, without copying data or attachment.

    Sets meta.attachment_size when the attachment is not empty (brpc leaves it absent otherwise).
    A list or tuple of buffers is one attachment made of its buffers one after the other (an
    IOBuf of several blocks): each goes to the socket as it is.
    """
    size = len(data)
    n = 0
    if attachment is not None:
        if type(attachment) is list or type(attachment) is tuple:
            views = attachment_views(attachment)
            n = sum(v.nbytes for v in views)
        else:
            view = attachment if type(attachment) is bytes else _fast.byte_view(attachment)
            views = [view]
            n = len(view) if type(view) is bytes else view.nbytes
    if n == 0:
        head = _fast.pack_head(magic, meta, size)
        return [head, data] if size else [head]
    if n > 0x7FFFFFFF:
        raise LocalProtocolError(f"attachment of {n} bytes does not fit the int32 attachment_size")
    meta.attachment_size = n
    head = _fast.pack_head(magic, meta, size + n)
    return [head, data, *views] if size else [head, *views]


def buffers_size(buffers: list) -> int:
    """The bytes of a message given as a list of buffers (bytes or byte memoryviews); here,
    compiled with this module, since every message written is counted so."""
    n = 0
    for b in buffers:  # a loop, not sum(genexpr): no generator per message
        n += len(b) if type(b) is bytes else b.nbytes
    return n


def attachment_views(buffers) -> list:
    """The non-empty byte views of an attachment given as a list or tuple of buffers."""
    views = []
    for i, b in enumerate(buffers):
        try:
            v = _fast.byte_view(b)
        except LocalProtocolError as e:
            raise LocalProtocolError(f"attachment buffer #{i}: {e}") from None
        if v.nbytes:
            views.append(v)
    return views


def encode_data(meta, serialized, compress_type: int = 0, attachment=None,
                checksum_type: int = checksum.NONE, checksum_with_attachment: bool = False):
    """Compress `serialized` and fill the meta's compress/checksum fields. Returns the data.

    `checksum_type` is checksum.NONE or checksum.CRC32C (True counts as CRC32C). As C++ brpc,
    checksum_with_attachment is written whenever it is asked for, with or without a checksum
    or an attachment.
    """
    data = compress.compress(compress_type, serialized) if compress_type else serialized
    meta.compress_type = compress_type
    if checksum_type:
        if checksum_type != checksum.CRC32C:
            raise LocalProtocolError(f"unknown checksum type {checksum_type!r}")
        meta.checksum_type = checksum.CRC32C
        covered = None
        if checksum_with_attachment and attachment is not None:
            is_list = type(attachment) is list or type(attachment) is tuple
            covered = attachment_views(attachment) if is_list else _fast.byte_view(attachment)
        meta.checksum_value = checksum.compute(data, covered)
    if checksum_with_attachment:
        meta.checksum_with_attachment = True
    return data


def decode_data(meta, data, attachment, max_decompressed_size: int, code: int = EREQUEST):
    """Verify the checksum and decompress `data` as `meta` says. Errors are non-fatal."""
    ctype = meta.checksum_type
    if ctype:
        checksum.verify(ctype, meta.checksum_value, data, attachment,
                        bool(meta.checksum_with_attachment), code)
    ztype = meta.compress_type
    if ztype:
        return compress.decompress(ztype, data, max_decompressed_size, code)
    if len(data) > max_decompressed_size:
        raise RemoteProtocolError(
            f"data of {len(data)} bytes exceeds max_decompressed_size={max_decompressed_size}",
            code=code, fatal=False)
    return data
