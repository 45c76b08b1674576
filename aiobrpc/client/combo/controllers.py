"""The controllers of a combo channel's sub-calls: what they inherit from the call's
controller, and how the caller reaches them after the call (brpc's Controller::sub()).

A combo call keeps its sub-controllers in `cntl._sub_controllers`: for a ParallelChannel or
PartitionChannel one entry per sub-channel (None for a skipped one, or for all when the call
failed before any sub-call started); for a SelectiveChannel or DynamicPartitionChannel one
entry, the controller of the sub-call that succeeded, or of the last one.

>>> from aiobrpc.controller import Controller
>>> main, sub = Controller(log_id=7, max_retry=1, timeout_ms=100), Controller()
>>> inherit_settings(main, sub, PARALLEL_SETTINGS)
>>> sub.log_id, sub.max_retry, sub.timeout_ms
(7, 1, -1)
"""

from __future__ import annotations

from ...controller import Controller
from ...errors import RpcError

# The client settings a sub-call inherits when the caller set them (brpc's ClientSettings,
# plus the aiobrpc ones of the same kind). Never the deadline: the combo channel's governs.
# request_code is taken when a Controller carries one (consistent-hashing load balancers).
_COMMON_SETTINGS = (
    "log_id", "request_id", "connection_type", "idempotent", "request_compress_type",
    "request_checksum_type", "request_checksum_with_attachment", "request_content_type", "trace_id",
    "request_code",
)
# ParallelChannel: a sub-call retries and sends its backup as the caller asked.
PARALLEL_SETTINGS = _COMMON_SETTINGS + ("max_retry", "backup_request_ms")
# SelectiveChannel: retries and the backup request are the selective channel's own, over
# sub-channels; a sub-channel retries within itself as its own options say.
SELECTIVE_SETTINGS = _COMMON_SETTINGS


def inherit_settings(main: Controller, sub: Controller, names: tuple[str, ...]) -> None:
    """Copy to `sub` the settings among `names` that `main` has set, and the request user
    fields; `sub` gets no deadline of its own (timeout_ms -1)."""
    own = main.__dict__
    for name in names:
        if name in own:
            setattr(sub, name, own[name])
    fields = main._request_user_fields
    if fields:
        sub.request_user_fields = fields  # the setter copies
    sub.timeout_ms = -1


def begin(cntl: Controller | None, service_name: str, method_name: str) -> Controller:
    """The controller of a new combo call, its last result and sub-controllers forgotten."""
    if cntl is None:
        cntl = Controller()
    elif not isinstance(cntl, Controller):
        raise TypeError(f"cntl must be an aiobrpc Controller, got {type(cntl).__name__}")
    else:
        cntl.reset_result()
        cntl.__dict__.pop("_sub_controllers", None)
    cntl.service_name = service_name
    cntl.method_name = method_name
    return cntl


def fail(cntl: Controller, code: int, text: str) -> RpcError:
    """Record the failure in `cntl`; the error to raise."""
    cntl.error_code = code
    cntl.error_text = text
    return RpcError(code, text)


def sub_count(cntl: Controller) -> int:
    """How many sub-controllers the last combo call of `cntl` has (0 after a plain call)."""
    subs = cntl.__dict__.get("_sub_controllers")
    return len(subs) if subs is not None else 0


def sub_controller(cntl: Controller, index: int) -> Controller | None:
    """The controller of sub-call `index` of the last combo call of `cntl`; None outside
    [0, sub_count), for a skipped sub-channel, or when the call ended before that sub-call
    started (as brpc's Controller::sub)."""
    subs = cntl.__dict__.get("_sub_controllers")
    if subs is None or not isinstance(index, int) or not 0 <= index < len(subs):
        return None
    return subs[index]
