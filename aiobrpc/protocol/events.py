"""Events a decoder yields. Views point into receive buffers, except a small attachment: it
is copied out so that keeping it does not keep a whole receive buffer alive."""

from __future__ import annotations


class MessageReceived:
    """A PRPC frame: `meta` (RpcMeta), `data` and `attachment` (memoryviews of the payload;
    the attachment is a view of its own copy when the buffer under it is more than 4x its
    size, see `_fast.split_payload`).

    `error` is a non-fatal RemoteProtocolError when the payload cannot be split as the meta
    says (attachment_size larger than the payload); the connection stays usable and only this
    message fails, with `error.code`.
    """

    __slots__ = ("meta", "data", "attachment", "error")

    def __init__(self, meta, data, attachment, error=None) -> None:
        self.meta = meta
        self.data = data
        self.attachment = attachment
        self.error = error

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(meta={self.meta!r}, data={len(self.data)}B, "
                f"attachment={len(self.attachment)}B, error={self.error!r})")


class RequestReceived(MessageReceived):
    """A request, as a server decodes it."""

    __slots__ = ()


class ResponseReceived(MessageReceived):
    """A response, as a client decodes it."""

    __slots__ = ()


class StreamFrameReceived:
    """A STRM frame: `meta` is the serialized StreamFrameMeta, `payload` the data."""

    __slots__ = ("meta", "payload")

    def __init__(self, meta, payload) -> None:
        self.meta = meta
        self.payload = payload

    def __repr__(self) -> str:
        return f"StreamFrameReceived(meta={bytes(self.meta).hex()}, payload={len(self.payload)}B)"
