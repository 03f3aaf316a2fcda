"""The pure-PyTorch layers (peft/, nn/, training/, and _gather) never import Lightning: they must work without `lightning`."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric'):
            raise ImportError(f'blocked import of {name}')
sys.meta_path.insert(0, Block())
import lightning_peft.peft as p
import torch
model = torch.nn.Sequential(torch.nn.Linear(4, 4))
p.inject_lora(model, rank=2, target_modules=['0'])
p.merge_lora(model)
p.unmerge_lora(model)
p.add_adapter(model, 'b', rank=1, target_modules=['0'])
with p.route_adapters(model, ['b', None, 'default']):
    model(torch.randn(3, 4)).sum().backward()
import lightning_peft.training as t
model[0].lora_A["default"].weight.grad = torch.zeros(2, 4)
t.add_gradient_noise(model.parameters(), 0, 0.1)
assert t.AccumulationSchedule({0: 1, 3: 4}).windows(10) == [1, 1, 1, 4, 3]
assert len(list(t.CurriculumSampler([2.0, 1.0, 0.0], batch_size=1, duration=2))) == 3
assert len(t.layerwise_lr_groups(torch.nn.ModuleDict({'layers': torch.nn.ModuleList([torch.nn.Linear(2, 2)])}), 1.0, 0.5)) == 2
import lightning_peft.nn as n
assert n.TokenPruner(0.5).token_counts(8, 2) == [8, 4]
moe = n.MoE(8, 16, 4); assert moe(torch.randn(2, 3, 8)).shape == (2, 3, 8) and moe.aux_loss is not None
encoder = n.TransformerEncoder(vocab_size=20, hidden_size=8, num_layers=2, num_heads=2, ffn_size=16,
                               token_pruner=n.TokenPruner(0.5))
assert encoder(torch.tensor([[1, 2, 3, 4]])).shape == (1, 4, 8)
assert n.TransformerDecoder(vocab_size=20, hidden_size=8, num_layers=1, num_heads=2)(torch.tensor([[1, 2]])).shape == (1, 2, 20)
import lightning_peft.peft.checkpoint as c
assert set(c.frozen_base(model)) == {"0.base_layer.weight", "0.base_layer.bias"}  # what an adapter-only checkpoint drops
import lightning_peft._gather as g
with g.gathered(model) as same:  # no sharded parameter: nothing to gather
    assert same is model
assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules)
print('ok')
"""


def test_peft_layer_imports_and_runs_with_lightning_blocked():
    result = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_blocker_really_blocks_lightning():
    code = BLOCKER.split("import lightning_peft.peft")[0] + "import lightning_peft.callbacks\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "blocked import of lightning" in result.stderr
