"""The wildcards of /vars/<glob> and /flags/<glob>, as brpc's: `*` (any run of characters) and
`?` (one character), several patterns joined by `;`.

A peer chooses the pattern, so it is bounded (MAX_GLOB_CHARS, MAX_WILDCARDS, MAX_PATTERNS) and matched in
time linear in the name for each of its pieces: the text between two `*` is found leftmost in
order (which decides a glob), never by backtracking, and nothing is compiled or cached, so a
stream of distinct patterns costs nothing that outlives its request.

>>> GlobList("rpc_*;*_count").matches("process_connection_count")
True
>>> GlobList("a?c").matches("abc"), GlobList("a?c").matches("abbc")
(True, False)
"""

from __future__ import annotations

MAX_GLOB_CHARS = 512
MAX_WILDCARDS = 32
MAX_PATTERNS = 16


class GlobError(ValueError):
    """A pattern past the bounds; its text says which."""


class GlobList:
    """Patterns joined by `;` (an empty list matches everything)."""

    __slots__ = ("patterns",)

    def __init__(self, text: str) -> None:
        if len(text) > MAX_GLOB_CHARS:
            raise GlobError(f"the pattern is {len(text)} characters, over {MAX_GLOB_CHARS}")
        wildcards = text.count("*") + text.count("?")
        if wildcards > MAX_WILDCARDS:
            raise GlobError(f"the pattern has {wildcards} wildcards, over {MAX_WILDCARDS}")
        patterns = [p.split("*") for p in text.split(";") if p]
        if len(patterns) > MAX_PATTERNS:
            raise GlobError(f"{len(patterns)} patterns, over {MAX_PATTERNS}")
        self.patterns = patterns or [["", ""]]

    def matches(self, name: str) -> bool:
        return any(_match(pieces, name) for pieces in self.patterns)


def _match(pieces: list, name: str) -> bool:
    """Whether `name` matches the pattern whose text between `*`s is `pieces`."""
    first, last = pieces[0], pieces[-1]
    if len(pieces) == 1:
        return len(first) == len(name) and _at(first, name, 0)
    if len(first) + len(last) > len(name) or not _at(first, name, 0) or not _at(last, name, len(name) - len(last)):
        return False
    pos, end = len(first), len(name) - len(last)
    for piece in pieces[1:-1]:
        pos = _find(piece, name, pos, end)
        if pos < 0:
            return False
        pos += len(piece)
    return True


def _at(piece: str, name: str, pos: int) -> bool:
    """Whether `piece` (with `?`) matches `name` at `pos`."""
    if "?" not in piece:
        return name.startswith(piece, pos)
    if pos + len(piece) > len(name):
        return False
    return all(c == "?" or c == name[pos + i] for i, c in enumerate(piece))


def _find(piece: str, name: str, start: int, end: int) -> int:
    """The leftmost position in name[start:end] where `piece` matches, or -1."""
    if "?" not in piece:
        return name.find(piece, start, end)
    for pos in range(start, end - len(piece) + 1):
        if _at(piece, name, pos):
            return pos
    return -1
