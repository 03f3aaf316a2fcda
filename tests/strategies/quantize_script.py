"""Run on 2 ranks by tests/strategies/test_quantize.py: LoRA on a quantized base (``LoRA(quantize=...)``) under DDP
(NF4 and int8) and native ZeRO stage 3 (FSDP2 sharding the NF4 weights), one epoch of 5 optimizer steps each, in one
process group; and the refusal of an int8 base under FSDP2.

Usage: ``python quantize_script.py OUT`` on each rank, with MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK
and NODE_RANK set as torchrun sets them. Rank 0 writes ``OUT/results.pt``: per case the trained adapter (gathered)
and the one it started from, and whether every rank held the same base values (DDP), or the error the case was
refused with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_peft._gather import gathered  # noqa: E402
from lightning_peft.callbacks import LoRA  # noqa: E402
from lightning_peft.peft import adapter_state_dict  # noqa: E402
from lightning_peft.peft._common import dense_weight  # noqa: E402
from lightning_peft.peft.quantize import quantized_layers  # noqa: E402
from lightning_peft.strategies import ZeROStrategy  # noqa: E402
from tests.strategies._launch import exit_worker  # noqa: E402
from tests.strategies.zero_script import LORA, Classifier, trainer  # noqa: E402

CASES = {  # name -> (strategy, quantize method)
    "ddp-nf4": (lambda: "ddp", "nf4"),
    "ddp-int8": (lambda: "ddp", "int8"),
    "native3-nf4": (lambda: ZeROStrategy(stage=3, backend="native"), "nf4"),
    "native3-int8": (lambda: ZeROStrategy(stage=3, backend="native"), "int8"),
}


def same_base_on_every_rank(module) -> bool:
    """Whether every rank holds rank 0's dequantized base values (DDP: the quantized weights were broadcast)."""
    checks = []
    for layer in quantized_layers(module.model).values():
        local = dense_weight(layer.weight).contiguous()
        first = local.clone()
        torch.distributed.broadcast(first, src=0)
        checks.append(torch.equal(local, first))
    return bool(checks) and all(checks)


class First(Callback):
    """The adapter as training starts (the reference starts from it)."""

    def on_train_start(self, trainer, pl_module):
        with gathered(pl_module):
            self.adapter = {k: v.detach().clone() for k, v in adapter_state_dict(pl_module.model).items()}


def run(out: Path, name: str) -> dict:
    make, method = CASES[name]
    module, first = Classifier(lora=False), First()
    if name.startswith("ddp"):  # rank 1 builds another base: DDP must start every rank from rank 0's
        with torch.no_grad():
            module.model.bert.encoder.layer[0].attention.self.query.weight.add_(float(os.environ["RANK"]))
    fit = trainer(make(), out / name, 1, [LoRA(**LORA, quantize=method), first], enable_checkpointing=False)
    try:
        fit.fit(module)
    except RuntimeError as error:  # refused at setup, on every rank alike
        return {"error": str(error)}
    result = {"same_base": same_base_on_every_rank(module) if name.startswith("ddp") else None, "first": first.adapter}
    with gathered(module):
        result["adapter"] = {k: v.detach().clone() for k, v in adapter_state_dict(module.model).items()}
    return result


def every_case(out: Path) -> None:
    """The job ``quantize`` of ``tests/_two_ranks.py``: every case; rank 0 writes ``OUT/results.pt``."""
    results = {name: run(out, name) for name in CASES}
    if int(os.environ["RANK"]) == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    every_case(Path(sys.argv[1]))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    exit_worker()
