"""``kvstore.torch.DiLoCo`` with CUDA models through real servers: the same job on the GPU and on
the CPU (2 workers x 2 servers, dense and 2-bit pseudo-gradients, outer Nesterov, a checkpoint of
the wrapper's state) ends with the same outer weights, to the rounding that the GPU's own inner
steps (cuBLAS matrix products) introduce, and the wrapper's tensors stay on the GPU.
"""

from __future__ import annotations

import copy

import pytest
from diloco_oracles import WORKERS, make_net
from kvtest import connect, require_cupy, run_ranks

import kvstore.torch as kvt

require_cupy()
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA", allow_module_level=True)

OUTER = ("sgd", {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True})


def _loss(model: torch.nn.Module, rank: int, step: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 6, generator=gen).to(device)
    y = torch.randint(0, 3, (8,), generator=gen).to(device)
    return torch.nn.functional.cross_entropy(model(x), y)


def _train(addresses, device: str, compression) -> list[list[torch.Tensor]]:
    start = make_net()

    def rank_job(rank: int) -> list[torch.Tensor]:
        model = copy.deepcopy(start).to(device)
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DiLoCo(
                torch.optim.SGD(model.parameters(), lr=0.1),
                model.named_parameters(),
                kv=kv,
                sync_every=3,
                outer=OUTER,
                compression=compression,
            )
            for step in range(9):
                opt.zero_grad()
                _loss(model, rank, step, device).backward()
                opt.step()
            assert all(t.device.type == device for t in opt.outer_weights)
            state = opt.state_dict()  # CPU copies of θ, whatever the device
            assert all(t.device.type == "cpu" for t in state["kvstore_diloco"]["outer_weights"])
            opt.load_state_dict(state)
            return [t.detach().cpu().clone() for t in opt.outer_weights]

    return run_ranks(WORKERS, rank_job, timeout=120)


@pytest.mark.parametrize("compression", [None, {"type": "2bit", "threshold": 2.0**-6}])
def test_cuda_models_train_as_cpu_models(servers_factory, compression):
    gpu = _train(servers_factory(2, 2), "cuda", compression)
    cpu = _train(servers_factory(2, 2), "cpu", compression)
    for rank in range(WORKERS):
        for got, want in zip(gpu[rank], cpu[rank], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for got, want in zip(gpu[0], gpu[1], strict=True):  # every worker pulled the same θ
        assert torch.equal(got, want)
