"""The parallel/ layer imports and runs with Lightning blocked; strategies/ never loads the callbacks."""

from __future__ import annotations

import subprocess
import sys

from tests._models import run_with_lightning_blocked

BLOCKED = """
import torch
from torch import nn
import lightning_peft.parallel as par
import lightning_peft.parallel.zero as zero
from lightning_peft.nn import TransformerDecoder
from lightning_peft.peft import inject_lora
decoder = TransformerDecoder(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, ffn_size=32)
inject_lora(decoder, rank=2, target_modules=['q_proj', 'v_proj'])
assert sorted(par.adapter_wrappers(decoder)) == ['layers.0.attn.q_proj', 'layers.0.attn.v_proj',
                                                  'layers.1.attn.q_proj', 'layers.1.attn.v_proj']
assert par.auto_plan(decoder)['layers.0.attn.q_proj'] == 'colwise'
stages = par.split_pieces(par.pipeline_pieces(decoder), 2)
assert [p.name for p in stages[0]][0] == 'embed_tokens'
assert par.balanced_cuts([1, 1, 1, 1], 2) == [0, 0, 1, 1]
units = zero.fsdp_units(decoder)
assert units[0] is decoder.layers[0].attn.q_proj.base_layer and decoder.layers[1] in units
handle = par.dispatch_model(decoder, par.infer_device_map(decoder, ['cpu', 'cpu']))
assert decoder(torch.tensor([[1, 2]])).shape == (1, 2, 32)
handle.remove()
assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric') for m in sys.modules)
print('ok')
"""


def test_parallel_layer_runs_with_lightning_blocked():
    result = run_with_lightning_blocked(BLOCKED)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_strategies_do_not_load_the_callbacks():
    code = ("import sys, lightning_peft.strategies\n"
            "print(sorted(m for m in sys.modules if m.startswith('lightning_peft.callbacks')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
