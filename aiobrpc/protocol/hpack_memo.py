"""HPACK coders that remember the header blocks they have already coded, for the gRPC server and client.

A gRPC peer sends the same header block call after call: once its dynamic table holds the
fields, grpcio's request headers are nine indexed bytes (`c5 c4 83 86 c3 c2 c1 be bf`), and
the server's replies are the same `:status`/`content-type` block and the same `grpc-status: 0`
trailer. Coding such a block neither reads nor changes anything but the dynamic table, so
while the table is unchanged the same input codes to the same output. `hpack` (pure Python)
spends about a fifth of a small call's server time re-decoding the same nine bytes.

`MemoDecoder` and `MemoEncoder` are `hpack`'s coders that keep, per connection, the blocks
whose coding left the table as it was, and answer them again while the table has not changed
since (a generation count kept by `_CountedTable`: every add and resize). A block that adds
to the table, changes its size, or is larger than `MEMO_BLOCK_BYTES` is coded by hpack every
time. Each memo is bounded by `MEMO_ENTRIES` and emptied when full or stale.
"""

from __future__ import annotations

import hpack
from hpack.table import HeaderTable

MEMO_ENTRIES = 32  # blocks remembered per coder: a connection's calls repeat a handful
MEMO_BLOCK_BYTES = 512  # a longer header block (coded, or the encoder's headers) is coded afresh each time


class _CountedTable(HeaderTable):
    """hpack's HeaderTable counting its changes: a memo is valid only for one generation."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.generation += 1
        super().add(name, value)

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, newmax: int) -> None:
        self.generation += 1
        HeaderTable.maxsize.fset(self, newmax)


class MemoDecoder(hpack.Decoder):
    def __init__(self, max_header_list_size: int = hpack.hpack.DEFAULT_MAX_HEADER_LIST_SIZE) -> None:
        super().__init__(max_header_list_size)
        self.header_table = _CountedTable()
        self._memo: dict = {}
        self._memo_state = (0, max_header_list_size)

    def decode(self, data, raw: bool = False):
        if len(data) > MEMO_BLOCK_BYTES:
            return super().decode(data, raw)
        table = self.header_table
        memo = self._memo
        state = (table.generation, self.max_header_list_size)
        if state != self._memo_state:
            memo.clear()
            self._memo_state = state
        key = (data if type(data) is bytes else bytes(data), raw)
        headers = memo.get(key)
        if headers is not None:
            self._assert_valid_table_size()  # max_allowed_table_size may have shrunk since
            return list(headers)
        headers = super().decode(data, raw)
        if table.generation == state[0]:
            if len(memo) >= MEMO_ENTRIES:
                memo.clear()
            memo[key] = tuple(headers)
        return headers


class MemoEncoder(hpack.Encoder):
    def __init__(self) -> None:
        super().__init__()
        self.header_table = _CountedTable()
        self._memo: dict = {}
        self._memo_generation = 0

    def encode(self, headers, huffman: bool = True) -> bytes:
        table = self.header_table
        if table.resized or isinstance(headers, dict):
            return super().encode(headers, huffman)
        if type(headers) is not list:
            headers = list(headers)  # h2's header validation hands over a generator
        if len(headers) > 16:
            return super().encode(headers, huffman)
        for h in headers:
            # a HeaderTuple carries whether it may be indexed beside its value: coded by hpack
            if type(h) is not tuple:
                return super().encode(headers, huffman)
        memo = self._memo
        generation = table.generation
        if generation != self._memo_generation:
            memo.clear()
            self._memo_generation = generation
        key = (tuple(headers), huffman)
        block = memo.get(key)
        if block is not None:
            return block
        block = super().encode(headers, huffman)
        if table.generation == generation and sum(len(h[0]) + len(h[1]) for h in headers) <= MEMO_BLOCK_BYTES:
            if len(memo) >= MEMO_ENTRIES:
                memo.clear()
            memo[key] = block
        return block


def install(connection) -> None:
    """Give an h2 connection memo coders, before it has coded any header block."""
    decoder = MemoDecoder(connection.decoder.max_header_list_size)
    decoder.max_allowed_table_size = connection.decoder.max_allowed_table_size
    connection.decoder = decoder
    connection.encoder = MemoEncoder()
