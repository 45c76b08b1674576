"""aiobrpc.training.ps with torch: a torch model's parameters pushed and pulled as tensors (into the
parameters themselves), and the server's Adam equal to torch.optim.Adam."""

from __future__ import annotations

import numpy as np
import pytest

from aiobrpc.training.ps import Adam, PsWorker
from tests.helpers.loop_errors import loop_errors  # noqa: F401  (autouse fixture)
from tests.training.ps_helpers import running_ps

torch = pytest.importorskip("torch", reason="torch (the 'train' extra) is installed for Python 3.11 only")


async def test_a_torch_model_trains_through_the_server_with_torchs_adam():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    reference = torch.nn.Linear(4, 3).double()
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    x, y = torch.randn(32, 4, dtype=torch.float64), torch.randn(32, 3, dtype=torch.float64)
    params = dict(model.named_parameters())
    async with running_ps(2, num_workers=1, mode="sync", optimizer=Adam(lr=0.05)) as ps:
        async with PsWorker([server.address for server, _ in ps], 0) as w:
            await w.init({k: p.detach() for k, p in params.items()})
            for _ in range(5):
                dests = {k: p.data for k, p in params.items()}  # the parameters' own memory
                got = await w.pull(out=dests)
                assert all(got[k] is dests[k] and got[k].data_ptr() == params[k].data_ptr() for k in params)
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                await w.push({k: p.grad for k, p in params.items()})
                ref_opt.zero_grad()
                torch.nn.functional.mse_loss(reference(x), y).backward()
                ref_opt.step()
            final = await w.pull(torch=True)
    for name, p in reference.named_parameters():
        assert isinstance(final[name], torch.Tensor)
        np.testing.assert_allclose(final[name].numpy(), p.detach().numpy(), rtol=1e-10, atol=1e-12)
