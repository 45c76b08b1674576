"""Controller: the per-call settings and results, on both sides (client.md §4).

>>> cntl = Controller(log_id=7, timeout_ms=100)
>>> cntl.request_user_fields["tenant"] = "a"
>>> cntl.failed
False
"""

from __future__ import annotations

from typing import Any

from .errors import EINTERNAL, describe


class Controller:
    """Settings of one call (client) or the view of one request (server).

    Client side: set `log_id`, `timeout_ms`, `request_compress_type`, `request_checksum`,
    `request_attachment`, `request_user_fields`, `request_id`; after the call read
    `response_attachment`, `response_user_fields`, `failed`, `error_code`, `error_text`,
    `latency_us`, `remote_side`.

    Server side: the request's fields are filled in (`log_id`, `timeout_ms` is the deadline
    the client propagated or None, `request_attachment`, `request_user_fields`,
    `authentication_data`, `remote_side`); the handler may set `response_attachment`,
    `response_user_fields`, `response_compress_type`, `response_checksum`, call
    `set_failed(code, text)` or `close_connection(reason)`.
    """

    __slots__ = (
        "log_id", "timeout_ms", "request_id", "max_retry",
        "request_compress_type", "response_compress_type", "request_checksum",
        "response_checksum", "request_checksum_with_attachment", "request_attachment",
        "response_attachment", "_request_user_fields", "_response_user_fields",
        "authentication_data", "remote_side", "local_side", "latency_us", "error_code",
        "error_text", "retried_count", "has_backup_request", "service_name", "method_name",
        "correlation_id", "_close_reason", "request_content_type", "__weakref__",
    )

    def __init__(self, *, log_id: int | None = None, timeout_ms: int | None = None,
                 request_id: str | None = None, max_retry: int | None = None,
                 request_compress_type: int = 0,
                 request_checksum: bool = False, request_checksum_with_attachment: bool = False,
                 request_attachment: Any = None) -> None:
        if log_id is not None and not (isinstance(log_id, int) and 0 <= log_id < 1 << 64):
            raise ValueError(f"log_id must be an int in 0..2**64-1, got {log_id!r}")
        if timeout_ms is not None and (not isinstance(timeout_ms, int) or timeout_ms < -1):
            raise ValueError(f"timeout_ms must be -1 or an int >= 0, got {timeout_ms!r}")
        self.log_id = log_id
        self.timeout_ms = timeout_ms
        self.request_id = request_id
        self.max_retry = max_retry
        self.request_compress_type = request_compress_type
        self.response_compress_type = 0
        self.request_checksum = request_checksum
        self.response_checksum = False
        self.request_checksum_with_attachment = request_checksum_with_attachment
        self.request_attachment = request_attachment
        self.response_attachment: Any = None
        self._request_user_fields: dict[str, str] | None = None
        self._response_user_fields: dict[str, str] | None = None
        self.authentication_data: bytes | None = None
        self.remote_side = ""
        self.local_side = ""
        self.latency_us = 0
        self.error_code = 0
        self.error_text = ""
        self.retried_count = 0
        self.has_backup_request = False
        self.service_name = ""
        self.method_name = ""
        self.correlation_id = 0
        self._close_reason: str | None = None
        self.request_content_type = 0

    @property
    def request_user_fields(self) -> dict[str, str]:
        if self._request_user_fields is None:
            self._request_user_fields = {}
        return self._request_user_fields

    @request_user_fields.setter
    def request_user_fields(self, value: dict[str, str]) -> None:
        self._request_user_fields = dict(value)

    @property
    def response_user_fields(self) -> dict[str, str]:
        if self._response_user_fields is None:
            self._response_user_fields = {}
        return self._response_user_fields

    @response_user_fields.setter
    def response_user_fields(self, value: dict[str, str]) -> None:
        self._response_user_fields = dict(value)

    @property
    def failed(self) -> bool:
        return self.error_code != 0

    def set_failed(self, code: int = EINTERNAL, text: str = "") -> None:
        """Fail the call with `code` (brpc's -1 is sent as EINTERNAL) and `text`."""
        if not isinstance(code, int) or code == 0:
            raise ValueError(f"set_failed needs a non-zero int code, got {code!r}")
        if self.error_text and text:
            self.error_text += " " + text  # brpc appends repeated SetFailed texts
        else:
            self.error_text = text or describe(code)
        self.error_code = code

    def close_connection(self, reason: str = "") -> None:
        """Server side: close the connection after this handler instead of replying."""
        self._close_reason = reason or "closed by the service"

    def reset_result(self) -> None:
        self.error_code = 0
        self.error_text = ""
        self.response_attachment = None
        self._response_user_fields = None

    def __repr__(self) -> str:
        state = f"failed [E{self.error_code}]{self.error_text}" if self.failed else "ok"
        return f"<Controller {self.service_name}/{self.method_name} {state} {self.latency_us}us>"
