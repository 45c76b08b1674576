"""What aiobrpc changes in the `h2` stack it uses, once, for the gRPC server and client.

h2 reprs every frame it receives for its trace log, even with logging off, and hyperframe's
`_raw_data_repr` hexlifies a DATA frame's whole payload to keep 20 characters of it: 30 % of
a server's time with 1 MiB messages. `_data_repr` gives the same text from the first 11
bytes. Importing this module installs it (`aiobrpc.server.grpc.session` and
`aiobrpc.client.grpc_connection` do, when they first need h2).
"""

from __future__ import annotations

import binascii

import hyperframe.frame


def _data_repr(data) -> str:
    """hyperframe's `_raw_data_repr`, the same text, from the first 11 bytes only."""
    if not data:
        return "None"
    r = binascii.hexlify(data[:11]).decode("ascii")
    if len(r) > 20:
        r = r[:20] + "..."
    return "<hex:" + r + ">"


hyperframe.frame._raw_data_repr = _data_repr
