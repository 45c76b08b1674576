"""Where the pieces of a tensor go in a ring: chunks per rank, segments per chunk, steps.

N ranks, rank r sends to r+1 and receives from r-1 (mod N). A tensor of `numel` elements is
cut into N chunks (sizes differing by at most one element) and each chunk into segments of at
most `segment_elems` elements: a segment is what one call carries, so sending, receiving and
reducing overlap segment by segment.

Reduce-scatter: at step t (0 <= t < N-1) rank r sends chunk (r - t) mod N and receives chunk
(r - 1 - t) mod N, which it combines with its own; after N-1 steps it holds chunk (r + 1) mod N
fully reduced. All-gather: at step t rank r sends chunk (r + 1 - t) mod N and receives chunk
(r - t) mod N, which it stores; in all-reduce these steps follow the reduce-scatter steps.
"""

from __future__ import annotations


class Layout:
    """Chunk and segment boundaries of a `numel`-element tensor in a ring of `world` ranks."""

    __slots__ = ("world", "numel", "segment_elems", "bounds")

    def __init__(self, world: int, numel: int, segment_elems: int) -> None:
        if world < 1 or numel < 0 or segment_elems < 1:
            raise ValueError(f"bad ring layout: world={world}, numel={numel}, segment_elems={segment_elems}")
        self.world = world
        self.numel = numel
        self.segment_elems = segment_elems
        base, extra = divmod(numel, world)
        self.bounds = [c * base + min(c, extra) for c in range(world + 1)]

    def chunk(self, c: int) -> tuple[int, int]:
        """[start, end) of chunk c (taken mod world)."""
        c %= self.world
        return self.bounds[c], self.bounds[c + 1]

    def segments(self, c: int) -> int:
        """How many segments chunk c has (0 for an empty chunk)."""
        start, end = self.chunk(c)
        return -(-(end - start) // self.segment_elems)

    def segment(self, c: int, s: int) -> tuple[int, int]:
        """[start, end) of segment s of chunk c."""
        start, end = self.chunk(c)
        a = start + s * self.segment_elems
        if not 0 <= s or a >= end:
            raise IndexError(f"segment {s} of chunk {c % self.world} does not exist")
        return a, min(a + self.segment_elems, end)


def reduce_scatter_chunks(rank: int, world: int, step: int) -> tuple[int, int]:
    """(chunk sent, chunk received) by `rank` at reduce-scatter `step`."""
    return (rank - step) % world, (rank - 1 - step) % world


def all_gather_chunks(rank: int, world: int, step: int) -> tuple[int, int]:
    """(chunk sent, chunk received) by `rank` at all-gather `step` after a reduce-scatter."""
    return (rank + 1 - step) % world, (rank - step) % world
