"""Parameter servers on ephemeral 127.0.0.1 ports, and a toy regression to train against them."""

from __future__ import annotations

import contextlib

import numpy as np

import aiobrpc
from aiobrpc.training.ps import ParameterServer

DIM = 8
TRUE_W = (np.arange(DIM, dtype=np.float32) - 3) / 4
TRUE_B = np.float32(0.5)


def regression_data(seed: int, n: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Each worker's shard of y = x . TRUE_W + TRUE_B."""
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return x, x @ TRUE_W + TRUE_B


def regression_step(params: dict, x: np.ndarray, y: np.ndarray) -> tuple[float, dict]:
    """(loss, gradients) of the mean squared error."""
    err = x @ params["w"] + params["b"] - y
    grads = {"w": (2 * x.T @ err / len(y)).astype(np.float32), "b": np.float32(2 * err.mean())}
    return float(np.mean(err ** 2)), grads


INITIAL = {"w": np.zeros(DIM, np.float32), "b": np.zeros((), np.float32)}


@contextlib.asynccontextmanager
async def running_ps(shards: int = 1, **kwargs):
    """[(server, ParameterServer)] * shards; stopped (every connection closed) on exit."""
    running = []
    try:
        for _ in range(shards):
            ps = ParameterServer(**kwargs)
            server = aiobrpc.Server()
            server.add_service(ps)
            await server.start("127.0.0.1:0")
            running.append((server, ps))
        yield running
    finally:
        for server, ps in running:
            ps.stop()
            await server.stop()
            await server.join(timeout=2)
        assert not any(server.connections for server, _ in running)
