"""Issue 29 R3: the /vars and /flags globs are bounded, matched without backtracking or a
process-wide cache, and answered 400 past their bounds; within them they mean what fnmatch's
`*` and `?` mean."""

from __future__ import annotations

import fnmatch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiobrpc.server.glob import MAX_GLOB_CHARS, MAX_PATTERNS, MAX_WILDCARDS, GlobError, GlobList
from tests.e2e.test_http import fetch


@settings(max_examples=600, deadline=None)
@given(st.text("ab*?", max_size=12), st.text("ab", max_size=12))
def test_a_glob_means_what_fnmatch_means(pattern, name):
    assert GlobList(pattern).matches(name) == fnmatch.fnmatchcase(name, pattern or "*")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text("ab*?", min_size=1, max_size=6), min_size=1, max_size=4), st.text("ab", max_size=10))
def test_patterns_joined_by_semicolons_match_any(patterns, name):
    assert GlobList(";".join(patterns)).matches(name) == any(fnmatch.fnmatchcase(name, p) for p in patterns)


def test_the_bounds_are_named():
    GlobList("a" * MAX_GLOB_CHARS)
    GlobList("*" * MAX_WILDCARDS)
    with pytest.raises(GlobError, match=f"over {MAX_GLOB_CHARS}"):
        GlobList("a" * (MAX_GLOB_CHARS + 1))
    with pytest.raises(GlobError, match=f"{MAX_WILDCARDS + 1} wildcards, over {MAX_WILDCARDS}"):
        GlobList("a?" * (MAX_WILDCARDS + 1))
    GlobList(";".join(["a"] * MAX_PATTERNS))
    with pytest.raises(GlobError, match=f"{MAX_PATTERNS + 1} patterns, over {MAX_PATTERNS}"):
        GlobList(";".join(["a"] * (MAX_PATTERNS + 1)))


def test_the_worst_pattern_within_the_bounds_does_little_work():
    """The pieces between stars are found leftmost, once each: a name is scanned at most once
    per piece, so `a*a*...*b` against a long run of `a` costs no backtracking."""
    calls = 0
    import aiobrpc.server.glob as glob

    real = glob._find

    def counting(*args):
        nonlocal calls
        calls += 1
        return real(*args)

    glob._find = counting
    try:
        pattern = "a*" * (MAX_WILDCARDS - 1) + "b"
        assert not GlobList(pattern).matches("a" * 400)
        assert GlobList(pattern).matches("a" * 400 + "b")
    finally:
        glob._find = real
    assert calls <= 2 * MAX_WILDCARDS


@pytest.mark.parametrize("page", ["vars", "flags"])
async def test_a_pattern_past_the_bounds_is_400_and_caches_nothing(page):
    import aiobrpc

    async with aiobrpc.Server(aiobrpc.ServerOptions()) as srv:
        await srv.start("127.0.0.1:0")
        before = fnmatch._compile_pattern.cache_info().currsize
        status, _, body = await fetch(srv, "GET", f"/{page}/" + "a*" * 4000)
        assert status == 400 and b"over" in body
        for i in range(50):  # distinct patterns within the bounds leave nothing behind
            status, _, _ = await fetch(srv, "GET", f"/{page}/max_*{i}?format=json")
            assert status == 200
        assert fnmatch._compile_pattern.cache_info().currsize == before
        prefix = "max_" if page == "flags" else "process_"
        status, _, body = await fetch(srv, "GET", f"/{page}/{prefix}*?format=json")
        assert status == 200 and prefix.encode() in body
