"""CRC32C checksums of baidu_std payloads (brpc's src/brpc/policy/baidu_rpc_protocol.cpp).

Computed over the wire bytes of `data` (after serialization and compression), continued over
the attachment when checksum_with_attachment is true, masked LevelDB-style and stored as 4
bytes big-endian. The crc32c package takes buffers, so nothing is copied.
"""

from __future__ import annotations

import crc32c as _crc32c

from ..errors import EREQUEST, RemoteProtocolError

NONE = 0
CRC32C = 1
NAMES = {NONE: "none", CRC32C: "crc32c"}
_MASK_DELTA = 0xA282EAD8


def name(ctype: int) -> str:
    return NAMES.get(ctype, "unknown")


def mask(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def unmask(masked: int) -> int:
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def crc32c(data, attachment=None) -> int:
    """Plain CRC-32C of data, continued over attachment if given (a buffer or a list of them)."""
    crc = _crc32c.crc32c(data)
    if type(attachment) is list:
        for block in attachment:
            crc = _crc32c.crc32c(block, crc)
    elif attachment is not None:
        crc = _crc32c.crc32c(attachment, crc)
    return crc


def compute(data, attachment=None) -> bytes:
    """The 4-byte checksum_value brpc writes."""
    return mask(crc32c(data, attachment)).to_bytes(4, "big")


def verify(checksum_type: int | None, value: bytes | None, data, attachment, with_attachment: bool,
           code: int = EREQUEST) -> None:
    """Raise RemoteProtocolError(fatal=False) unless the checksum holds.

    Stricter than brpc: an unknown checksum_type is an error (docs/hostile_inputs.md C7), where
    C++ would serve the message unchecked.
    """
    if not checksum_type:
        return
    if checksum_type != CRC32C:
        raise RemoteProtocolError(f"ChecksumType=unknown ({checksum_type})", code=code, fatal=False)
    if value is None or len(value) != 4:
        size = 0 if value is None else len(value)
        raise RemoteProtocolError(f"crc32c checksum_value must be 4 bytes, got {size}", code=code, fatal=False)
    expected = compute(data, attachment if with_attachment else None)
    if expected != value:
        raise RemoteProtocolError(
            f"crc32c checksum mismatch: got {bytes(value).hex()}, computed {expected.hex()}",
            code=code, fatal=False)
