"""lightning_peft._grads on one process: plain gradients, DTensor gradients on a 1-process gloo mesh (in a subprocess,
with lightning blocked: the module is pure), and the errors. Sharded layouts on 2 ranks (FSDP2, TP, DeepSpeed 1-3)
are checked against one process by the compatibility matrix (tests/matrix: GradientNoise under every strategy)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_peft._grads import add_to_grad, full_shape, grad_kind, local_grad, local_part, set_local_grad


def test_plain_gradients_are_read_changed_and_written_whole():
    p = nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    assert grad_kind(p) == "plain" and full_shape(p) == (3, 2)
    assert local_grad(p) is None
    assert add_to_grad(p, lambda shape: pytest.fail("drawn for a parameter without a gradient")) is False
    p.grad = torch.ones(3, 2, dtype=torch.float64)
    full = torch.arange(6.0).reshape(3, 2)  # float32, added in the gradient's dtype
    assert local_part(p, full) is full
    assert add_to_grad(p, full, alpha=0.5) is True
    torch.testing.assert_close(p.grad, 1 + 0.5 * full.double(), rtol=0, atol=0)
    set_local_grad(p, torch.zeros(3, 2))
    assert torch.equal(p.grad, torch.zeros(3, 2, dtype=torch.float64))


def test_a_full_tensor_of_another_shape_and_a_missing_gradient_are_errors():
    p = nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"local_part: got a tensor of shape \(2, 3\) for a parameter of shape \(3, 2\)"):
        local_part(p, torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match=r"set_local_grad: the parameter of shape \(3, 2\) has no gradient"):
        set_local_grad(p, torch.zeros(3, 2))
    p.grad = torch.zeros(3, 2).to_sparse()
    with pytest.raises(TypeError, match=r"add_to_grad: a sparse gradient cannot take a dense update"):
        add_to_grad(p, torch.zeros(3, 2))


DTENSOR = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric', 'deepspeed'):
            raise ImportError(f'blocked import of {name}')
sys.meta_path.insert(0, Block())
import os, torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from lightning_peft._grads import add_to_grad, full_shape, grad_kind, local_grad, local_part

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
full = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
for placement in (Shard(0), Shard(1), Replicate()):
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(5, 3), mesh, [placement]))
    assert grad_kind(p) == "dtensor" and full_shape(p) == (5, 3)
    p.grad = distribute_tensor(torch.ones(5, 3), mesh, [placement])
    assert torch.equal(local_part(p, full), full)
    assert add_to_grad(p, full, alpha=2.0)
    assert isinstance(p.grad, DTensor) and p.grad.placements == (placement,)
    assert torch.equal(p.grad.full_tensor(), 1 + 2 * full)
# A gradient with pending sums (tensor parallelism leaves them on replicated parameters) is reduced first.
p = torch.nn.Parameter(distribute_tensor(torch.zeros(5, 3), mesh, [Replicate()]))
p.grad = DTensor.from_local(torch.ones(5, 3), mesh, [Partial()])
assert torch.equal(local_grad(p), torch.ones(5, 3)) and p.grad.placements == (Replicate(),)
dist.destroy_process_group()
assert 'deepspeed' not in sys.modules and not any(m.split('.')[0] == 'lightning' for m in sys.modules)
print('ok')
"""


def test_dtensor_gradients_on_a_one_process_mesh_without_lightning_or_deepspeed():
    from tests.strategies._launch import free_port

    result = subprocess.run([sys.executable, "-c", DTENSOR, str(free_port())], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
