"""What a failed collective raises."""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective could not complete. `ranks` are the ranks found dead, hung or failing
    (empty when none could be named). A group that raised it is broken: every later collective
    raises it again, as NCCL's aborted communicators do; make a new group to go on."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within the group's timeout."""
