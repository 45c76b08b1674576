"""A griffe extension for the API reference: doctest examples render as Python code.

The docstrings hold bare `>>>` examples (they are doctests), which Markdown would render as
nested block quotes. Each run of lines from a `>>>` line to the next blank line is fenced as
`pycon`, and doctest directives (`# doctest: +SKIP`) are dropped from what is shown.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_DIRECTIVE = re.compile(r"\s*# doctest:.*$")


def fence_doctests(text: str) -> str:
    """`text` with each doctest block fenced as pycon code."""
    out: list[str] = []
    in_block = False
    for line in text.split("\n"):
        if not in_block and line.startswith(">>>"):
            out.append("```pycon")
            in_block = True
        elif in_block and not line.strip():
            out.append("```")
            in_block = False
        out.append(_DIRECTIVE.sub("", line) if in_block else line)
    if in_block:
        out.append("```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
