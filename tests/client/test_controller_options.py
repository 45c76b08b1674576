"""Controller: per-call client settings and what a reused controller forgets."""

from __future__ import annotations

import pytest

import aiobrpc


def test_per_call_settings_are_kept():
    cntl = aiobrpc.Controller(idempotent=False, backup_request_ms=20, connection_type="pooled",
                              max_retry=1000)
    assert (cntl.idempotent, cntl.backup_request_ms, cntl.connection_type, cntl.max_retry) == (
        False, 20, "pooled", 1000)
    assert aiobrpc.Controller().idempotent is None  # the channel decides


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_retry=1001), "max_retry must be an int in 0..1000"),
    (dict(max_retry=-1), "max_retry must be an int in 0..1000"),
    (dict(backup_request_ms=-2), "backup_request_ms must be -1 or an int >= 0"),
    (dict(connection_type="udp"), "connection_type must be 'single', 'pooled' or 'short'"),
])
def test_wrong_settings_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        aiobrpc.Controller(**kwargs)


def test_reset_result_forgets_the_previous_call():
    cntl = aiobrpc.Controller(log_id=3)
    cntl.remote_side, cntl.local_side, cntl.correlation_id, cntl.latency_us = "a:1", "b:2", 9, 77
    cntl.set_failed(aiobrpc.errors.EEOF, "gone")
    cntl.retried_count, cntl.has_backup_request = 2, True
    cntl.reset_result()
    assert (cntl.remote_side, cntl.local_side, cntl.correlation_id, cntl.latency_us) == ("", "", 0, 0)
    assert not cntl.failed and cntl.retried_count == 0 and not cntl.has_backup_request
    assert cntl.attempts == [] and cntl.log_id == 3  # settings stay


def test_reset_result_forgets_the_previous_response_and_keeps_every_setting():
    cntl = aiobrpc.Controller(timeout_ms=50, max_retry=2, request_attachment=b"req", request_checksum=True)
    cntl.request_user_fields["k"] = "v"
    cntl.response_attachment = memoryview(b"resp")
    cntl._response_user_fields = {"a": "b"}
    cntl.response_compress_type, cntl.response_checksum_type = 1, 1
    cntl.response_checksum_with_attachment = True
    cntl.reset_result()
    assert cntl.response_attachment is None and cntl.response_user_fields == {}
    assert (cntl.response_compress_type, cntl.response_checksum_type) == (0, 0)
    assert cntl.response_checksum_with_attachment is False
    assert (cntl.timeout_ms, cntl.max_retry, cntl.request_attachment) == (50, 2, b"req")
    assert cntl.request_checksum and cntl.request_user_fields == {"k": "v"}
    fresh = aiobrpc.Controller(log_id=1)
    before = dict(vars(fresh))
    fresh.reset_result()  # nothing to forget
    assert vars(fresh) == before


def test_circuit_breaker_options_are_checked_when_the_options_are_made():
    opts = aiobrpc.ChannelOptions(enable_circuit_breaker=True,
                                  circuit_breaker_options={"short_window": 10, "short_error_percent": 20})
    assert opts.circuit_breaker_options["short_window"] == 10
    with pytest.raises(TypeError, match="circuit_breaker_options: .*bogus"):
        aiobrpc.ChannelOptions(circuit_breaker_options={"bogus": 1})
    with pytest.raises(ValueError, match="short_window must be an int >= 1"):
        aiobrpc.ChannelOptions(circuit_breaker_options={"short_window": 0})
