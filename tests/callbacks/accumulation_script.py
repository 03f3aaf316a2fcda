"""Run by tests/callbacks/test_gradient_accumulation.py on 2 ranks (gloo): ``GradientAccumulation(global_batch_size=32)``
under strategies whose ranks do not each read their own batch, against one process.

Usage: ``python accumulation_script.py OUT`` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK /
NODE_RANK set. Both fits share one process group; each rank computes the single-process reference itself
(``Trainer(accumulate_grad_batches=4)`` on the same batches of 8) and writes ``OUT/<case>-rank<r>.pt``: the count of
every optimizer step, the number of steps, its own (non-meta, full) weights and the reference's.

- ``pipeline``: ``PipelineStrategy(num_stages=2)``: both stages read every batch (data-parallel size 1);
- ``tensor``: ``TensorParallelStrategy(tensor_parallel_size=2)``: both ranks of the one group read it too.

On 2 processes ``trainer.world_size`` is 2: a count from it would be 2 (global batch 16, 4 steps), not 4.
"""

from __future__ import annotations


import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_peft.callbacks import GradientAccumulation  # noqa: E402
from lightning_peft.modules import CausalLM  # noqa: E402
from lightning_peft.strategies import PipelineStrategy, TensorParallelStrategy  # noqa: E402
from tests.strategies.pp_script import DECODER, VOCAB, loader, make_batches  # noqa: E402
from tests.strategies._launch import exit_worker  # noqa: E402

warnings.filterwarnings("ignore")


class SGDCausalLM(CausalLM):
    """Plain SGD, no schedule: the reference reproduces every step exactly."""

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


class Counts(Callback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.counts.append(int(trainer.accumulate_grad_batches))


def model() -> SGDCausalLM:
    torch.manual_seed(0)
    return SGDCausalLM(vocab_size=VOCAB, decoder=DECODER, warmup_fraction=0.0)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    full = {}
    for name, p in module.named_parameters():
        if p.device.type != "meta":
            value = p.full_tensor() if hasattr(p, "full_tensor") else p
            full[name] = value.detach().clone()
    return full


def run(out: Path, case: str, strategy, callbacks: list, devices: int = 2, **kwargs) -> tuple:
    counts, module = Counts(), model()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
        default_root_dir=out / case, callbacks=[*callbacks, counts], **kwargs,
    )
    trainer.fit(module, loader(make_batches(8, padded=False)))  # 8 batches of 8
    return module, counts.counts, trainer.global_step


def main(out: Path) -> None:
    results = {}
    for case, strategy in {
        "pipeline": lambda: PipelineStrategy(num_stages=2, num_microbatches=2),
        "tensor": lambda: TensorParallelStrategy(tensor_parallel_size=2),
    }.items():
        module, counts, steps = run(out, case, strategy(), [GradientAccumulation(global_batch_size=32, log=False)])
        results[case] = {"counts": counts, "steps": steps, "weights": weights(module)}
    rank = dist.get_rank()
    # After the distributed fits, in each process: the one-device Trainer runs inside the process group.
    reference, _, _ = run(out, f"reference-{rank}", "auto", [], devices=1, accumulate_grad_batches=4)
    expected = weights(reference)
    for case, result in results.items():
        result["expected"] = {k: expected[k] for k in result["weights"]}
        torch.save(result, out / f"{case}-rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    exit_worker()
