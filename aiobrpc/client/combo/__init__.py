"""Combo channels: channels made of channels (brpc's docs/en/combo_channel.md).

* `ParallelChannel`: each call goes to all its sub-channels at once; the responses are merged.
* `SelectiveChannel`: each call goes to one sub-channel, picked by a load balancer; retries
  and the backup request go to others.
* `PartitionChannel`: a ParallelChannel over the partitions of a sharded service, whose
  servers carry their partition ("N/M") in their naming-service tags.
* `DynamicPartitionChannel`: servers of several partitionings at once; each call goes to one
  partitioning, chosen in proportion to its capacity.

All have a Channel's `call_method`, so a `Stub` works over them, and they nest. After a call,
`sub_controller(cntl, i)` and `sub_count(cntl)` reach the sub-calls' controllers.
See docs/combo_channels.md.
"""

from __future__ import annotations

from .controllers import sub_controller, sub_count
from .dynamic_partition import MAX_PARTITIONINGS, DynamicPartitionChannel
from .dynpart import DynPartLoadBalancer
from .mapping import CallMapper, MergeResult, MethodRef, ResponseMerger, SubCall
from .members import MAX_SUB_CHANNELS
from .parallel import ParallelChannel, ParallelChannelOptions
from .partition import Partition, PartitionChannel, PartitionChannelOptions, PartitionParser
from .selective import SelectiveChannel

__all__ = [
    "MAX_PARTITIONINGS", "MAX_SUB_CHANNELS", "CallMapper", "DynPartLoadBalancer", "DynamicPartitionChannel",
    "MergeResult", "MethodRef", "ParallelChannel", "ParallelChannelOptions", "Partition", "PartitionChannel",
    "PartitionChannelOptions", "PartitionParser", "ResponseMerger", "SelectiveChannel", "SubCall",
    "sub_controller", "sub_count",
]
