"""Logging a naming service's faults once each, not once per poll or retry.

>>> faults = FaultLog("naming service file://servers.txt")
>>> faults.fault("file is missing", "keeping the last list (2 servers)")  # logged (WARNING)
>>> faults.fault("file is missing", "keeping the last list (2 servers)")  # the same: not logged
>>> faults.current
'file is missing'
>>> faults.recovered()  # logged (INFO), once
>>> faults.current is None
True
"""

from __future__ import annotations

import collections
import logging

log = logging.getLogger("aiobrpc.client.naming")

# How many distinct faults of one outage are remembered (not logged again); bounded memory.
REMEMBERED_FAULTS = 16


class FaultLog:
    """The faults of one naming service (or registration) since it last worked: each is logged the first time it
    happens (faults that alternate, like two endpoints failing in turn, are logged once each),
    and the recovery once, when the service works again."""

    def __init__(self, subject: str) -> None:
        self.subject = subject  # what the log lines are about, e.g. "naming service file://x"
        self.current: str | None = None  # the last fault, None while the service works
        self._seen: collections.deque[str] = collections.deque(maxlen=REMEMBERED_FAULTS)

    def fault(self, text: str, consequence: str = "") -> None:
        """Record a fault; logged (WARNING, with what follows from it) unless `text` was
        already recorded since the service last worked."""
        self.current = text
        if text not in self._seen:
            self._seen.append(text)
            log.warning("%s: %s%s", self.subject, text,
                        f"; {consequence}" if consequence else "")

    def recovered(self) -> None:
        """The service works again; logged (INFO) when there was a fault."""
        if self.current is not None:
            log.info("%s works again (was: %s)", self.subject, self.current)
            self.current = None
            self._seen.clear()
