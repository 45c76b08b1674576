"""The HTTP exchanges the docs show are self-consistent: a reply's Content-Length is the size
of the body shown under it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def shown_replies() -> list[tuple[str, int, bytes]]:
    """(page, Content-Length, body) of each reply in a ``` block of docs/ and the README."""
    replies = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", page.read_text(), re.S | re.M):
            for reply in re.findall(r"^HTTP/1\.1 .*?(?=^HTTP/1\.1 |\Z)", block, re.S | re.M):
                head, _, body = reply.partition("\n\n")
                length = re.search(r"^Content-Length: (\d+)$", head, re.M | re.I)
                if length:
                    replies.append((page.name, int(length.group(1)), body.rstrip("\n").encode()))
    return replies


def test_a_shown_reply_has_the_length_of_its_body():
    replies = shown_replies()
    assert any(page == "server.md" for page, _, _ in replies), "docs/server.md shows a reply"
    for page, length, body in replies:
        assert len(body) == length, f"{page}: Content-Length: {length} over a body of {len(body)} bytes: {body!r}"
