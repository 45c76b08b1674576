"""Server weights written in server tags, as brpc's weighted balancers read them.

A weight is the whole tag as a decimal uint32 >= 1 (butil::StringToUint): `"10.0.0.1:80 3"`
weighs 3. wrr and wr reject a server whose tag is not one unless a default weight is set
(brpc's -default_weight_of_wlb; here the LB parameter `default_weight=N`); p2c gives such a
server weight 1.

>>> tag_weight("25"), tag_weight(""), tag_weight("0"), tag_weight("x1")
(25, None, None, None)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..naming.base import ServerNode

logger = logging.getLogger(__name__)

MAX_WEIGHT = 0xFFFFFFFF

# brpc's -default_weight_of_wlb default: 0, a server with an invalid weight tag is rejected.
DEFAULT_WEIGHT_OF_WLB = 0


def tag_weight(tag: str) -> int | None:
    """The weight a tag gives, or None when the tag is not a decimal integer in 1..2**32-1."""
    if not tag.isascii() or not tag.isdigit():
        return None
    weight = int(tag)
    return weight if 0 < weight <= MAX_WEIGHT else None


def weighted_servers(lb_name: str, servers: Iterable[ServerNode],
                     default_weight: int) -> list[tuple[ServerNode, int]]:
    """(server, weight) of each server whose tag is a weight; a server with an invalid tag gets
    `default_weight` when it is > 0, otherwise it is left out (logged, as brpc does)."""
    weighted = []
    for server in servers:
        weight = tag_weight(server.tag)
        if weight is None:
            if default_weight > 0:
                logger.warning("%s: invalid weight tag %r of %s, using default_weight=%d",
                               lb_name, server.tag, server.address, default_weight)
                weight = default_weight
            else:
                logger.error("%s: invalid weight tag %r of %s: the server is not used (tag it "
                             "with a weight >= 1, or set default_weight=N)",
                             lb_name, server.tag, server.address)
                continue
        weighted.append((server, weight))
    return weighted
