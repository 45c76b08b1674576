"""Distributed training over aiobrpc, built on the public API like any user of the library:
`ps`, a parameter server."""
