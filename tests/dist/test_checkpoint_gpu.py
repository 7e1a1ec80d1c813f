"""Asynchronous checkpoints of a CUDA model: the background snapshot (device -> host copies) captures the
step being saved while the next steps run on the GPU; the checkpoint loads on CPU and back on CUDA."""

from __future__ import annotations

import pytest
import torch

from starverse.checkpoint import Checkpointer, CheckpointStore

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _model(device: str):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).to(device)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def _step(m, o, device: str) -> None:
    o.zero_grad()
    m(torch.randn(256, 512, device=device)).pow(2).mean().backward()
    o.step()


def test_async_snapshot_of_a_cuda_model_is_the_saved_step(tmp_path):
    m, o = _model("cuda")
    _step(m, o, "cuda")
    expected = {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
    expected_avg = o.state[m[0].weight]["exp_avg"].detach().cpu().clone()
    store = CheckpointStore(tmp_path)
    ck = Checkpointer(store, device_kind="h200-141gb-sxm")
    ck.save(1, m, o)
    for _ in range(5):  # GPU keeps updating the weights while the snapshot is copied out
        _step(m, o, "cuda")
    info = ck.wait()
    ck.close()
    assert info.device_kinds == ("h200-141gb-sxm",)

    cpu_m, cpu_o = _model("cpu")
    Checkpointer(store).load(info, cpu_m, cpu_o)
    for k, v in cpu_m.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert torch.equal(cpu_o.state[cpu_m[0].weight]["exp_avg"], expected_avg)

    gpu_m, gpu_o = _model("cuda")
    Checkpointer(store).load(info, gpu_m, gpu_o)
    assert gpu_m[0].weight.is_cuda and torch.equal(gpu_m[0].weight.cpu(), expected["0.weight"])
    assert gpu_o.state[gpu_m[0].weight]["exp_avg"].is_cuda
