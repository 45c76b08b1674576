"""aiobrpc.tensor with torch CPU tensors (torch is installed for Python 3.11 only)."""

from __future__ import annotations

import numpy as np
import pytest

from aiobrpc import tensor

torch = pytest.importorskip("torch", reason="torch (the 'train' extra) is installed for Python 3.11 only")

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


def sample(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def joined(buffers) -> memoryview:
    return memoryview(bytearray(b"".join(buffers)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_tensors_round_trip_byte_exact(dtype):
    ts = [sample(dtype, s, i) for i, s in enumerate([(), (0,), (5,), (3, 7), (2, 0, 3), (513,)])]
    meta, buffers = tensor.pack(ts)
    got = tensor.unpack(meta, joined(buffers), torch=True)
    for t, g in zip(ts, got):
        assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(g, t)


def test_pack_shares_the_tensor_memory_and_ignores_autograd():
    w = torch.zeros(1000, requires_grad=True)
    meta, (view,) = tensor.pack([w])
    with torch.no_grad():
        w[3] = 5.0
    assert np.frombuffer(view, np.float32)[3] == 5.0


def test_unpack_into_a_torch_destination_and_as_views():
    src = sample(torch.bfloat16, (4, 4))
    meta, buffers = tensor.pack({"x": src})
    dest = torch.empty(16, dtype=torch.bfloat16)
    (got,) = tensor.unpack(meta, joined(buffers), out=[dest])
    assert got is dest and torch.equal(dest.view(4, 4), src)
    att = joined(buffers)
    (view,) = tensor.unpack(meta, att, torch=True)
    att[0:2] = b"\x80\x3f"  # bfloat16 1.0
    assert view[0, 0].item() == 1.0


def test_numpy_and_torch_interoperate_on_the_wire():
    meta, buffers = tensor.pack([np.arange(5, dtype=np.int64)])
    (t,) = tensor.unpack(meta, joined(buffers), torch=True)
    assert t.tolist() == [0, 1, 2, 3, 4]
    meta, buffers = tensor.pack([torch.arange(5, dtype=torch.float16)])
    (a,) = tensor.unpack(meta, joined(buffers))
    assert a.dtype == np.float16 and a.tolist() == [0, 1, 2, 3, 4]


def test_torch_inputs_that_cannot_travel_are_named():
    with pytest.raises(ValueError, match=r"tensor #0 is not contiguous \(strides \(1, 3\)\)"):
        tensor.pack([torch.zeros(2, 3).t()])
    meta, buffers = tensor.pack([torch.arange(6.0).view(2, 3).t()], copy=True)
    assert tensor.unpack(meta, joined(buffers), torch=True)[0].tolist() == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match="unsupported dtype torch.complex64"):
        tensor.pack([torch.zeros(2, dtype=torch.complex64)])
