"""Run by tests/strategies/test_tensor_parallel.py on each of 2 ranks (gloo, CPU), started by the test itself.

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tp_script.py OUT_DIR (every section of SECTIONS)

Every check runs in one process group: the reference (the same model, unsplit) is computed in each process, so no
second launch is needed. Results go to OUT_DIR/<section>-rank<r>.pt (tensors and maximal errors); the test asserts.

Sections:
  pure      parallelize() on the project's decoder, HF BERT and HF Llama with LoRA: outputs and gradients (float64),
            5 SGD and 5 AdamW steps (float32) against the unsplit model; per-rank parameter bytes.
  peft      a tiny HF Llama trained 3 SGD steps under TP; rank 0 writes the adapter (gathered), the base model and
            the single-process reference logits for the test to load with peft.PeftModel.
  trainer   Lightning: CausalLM + LoRA and MergeOnSave callbacks under TensorParallelStrategy (tp=2, gradient clipping)
            against a plain loop; a resumed run against a straight one; the exported adapter; (dp=2, tp=1),
            resumed from an adapter-only checkpoint, against one process on the joint batch; the data-parallel
            (size, rank) each strategy reports.
  multilora (dp=2, tp=1) with MultiLoRA, the replicas routing different adapters, against one process on the
            joint batch (the final trainable parameters of both).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lightning_peft.peft import inject_lora  # noqa: E402
from tests.strategies._launch import exit_worker  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_error(a: nn.Module, b: nn.Module, grads: bool = False) -> float:
    """Largest absolute difference of the trainable parameters (or their gradients) of two models."""
    worst = 0.0
    pa = dict(a.named_parameters())
    for name, p in b.named_parameters():
        if not p.requires_grad:
            continue
        x, y = (pa[name].grad, p.grad) if grads else (pa[name], p)
        worst = max(worst, (full(x).detach() - full(y).detach()).abs().max().item())
    return worst


def randomise_lora(model: nn.Module, seed: int) -> None:
    """B starts at zero; give it values so that A gets gradients too (the same on every rank)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.1)


def tiny_decoder(dtype: torch.dtype) -> nn.Module:
    from lightning_peft.nn import TransformerDecoder

    torch.manual_seed(0)
    model = TransformerDecoder(
        vocab_size=32, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=32,
    ).to(dtype)
    inject_lora(model, rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                                       "gate_proj", "down_proj"])
    return model


def tiny_bert(dtype: torch.dtype) -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertModel(config, add_pooling_layer=False).to(dtype)
    inject_lora(model, rank=4, alpha=8, target_modules=["query", "key", "value", "dense"])
    return model


def tiny_llama(dtype: torch.dtype = torch.float32, lora: bool = True) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config).to(dtype)
    if lora:
        inject_lora(model, rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                                           "gate_proj", "down_proj"])
    return model


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    if hasattr(out, "logits"):
        return out.logits
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return out


def section_pure(out: Path, mesh) -> dict:
    from lightning_peft.parallel.dtensor import clip_grad_norm, local_parameter_bytes
    from lightning_peft.parallel.tensor_parallel import parallelize

    result: dict = {}
    ids = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(5))
    for label, build in (("decoder", tiny_decoder), ("bert", tiny_bert), ("llama", tiny_llama)):
        reference = build(torch.float64)
        randomise_lora(reference, 1)
        split = copy.deepcopy(reference)
        result[f"{label}_plan"] = parallelize(split, mesh)
        ref_out, tp_out = logits_of(reference, ids), logits_of(split, ids)
        result[f"{label}_output_error"] = (ref_out - tp_out).abs().max().item()
        weights = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(6), dtype=ref_out.dtype)
        (ref_out * weights).sum().backward()  # not a function of the norm alone (BERT's output is layer-normed)
        (tp_out * weights).sum().backward()
        result[f"{label}_grad_error"] = max_error(reference, split, grads=True)
        result[f"{label}_grad_norm"] = max(full(p.grad).abs().max().item() for p in reference.parameters()
                                            if p.requires_grad)
        result[f"{label}_bytes"] = (local_parameter_bytes(split), local_parameter_bytes(reference))
        if label == "decoder":  # the global gradient norm, and clipping by it, against torch's on the unsplit model
            for p in (*reference.parameters(), *split.parameters()):
                p.requires_grad_(True)  # plain (norm) and DTensor gradients together
            reference.zero_grad(), split.zero_grad()
            (logits_of(reference, ids) * weights).sum().backward()
            (logits_of(split, ids) * weights).sum().backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
            tp_norm = clip_grad_norm(split.parameters(), 1e-3)
            result["clip_norm_error"] = abs(ref_norm.item() - tp_norm.item()) / ref_norm.item()
            result["clip_grad_error"] = max_error(reference, split, grads=True)
    # Five optimizer steps in float32.
    for opt_name, make, in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.5)),
                            ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))):
        reference = tiny_decoder(torch.float32)
        randomise_lora(reference, 2)
        split = copy.deepcopy(reference)
        parallelize(split, mesh)
        opts = [make([p for p in m.parameters() if p.requires_grad]) for m in (reference, split)]
        generator = torch.Generator().manual_seed(7)
        for _ in range(5):
            batch = torch.randint(0, 32, (4, 8), generator=generator)
            for model, opt in zip((reference, split), opts):
                logits = model(batch)
                loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), batch[:, 1:].reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
        result[f"{opt_name}_step_error"] = max_error(reference, split)
        result[f"{opt_name}_moved"] = max_error(reference, tiny_decoder(torch.float32))
    return result


def section_peft(out: Path, mesh) -> dict:
    from lightning_peft._gather import gathered
    from lightning_peft.peft import save_adapter
    from lightning_peft.parallel.tensor_parallel import parallelize

    reference = tiny_llama(torch.float32)
    split = copy.deepcopy(reference)
    parallelize(split, mesh)
    generator = torch.Generator().manual_seed(3)
    for model in (reference, split):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        generator.manual_seed(3)
        for _ in range(3):
            batch = torch.randint(0, 32, (4, 8), generator=generator)
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        tp_logits = split(ids).logits
    with gathered(split):
        if RANK == 0:
            save_adapter(split, out / "llama_adapter")
    if RANK == 0:
        tiny_llama(torch.float32, lora=False).save_pretrained(out / "llama_base")  # the same seed: the same base
        with torch.no_grad():
            torch.save({"ids": ids, "logits": reference(ids).logits, "tp_logits": tp_logits}, out / "llama_ref.pt")
    return {"tp_vs_single": (tp_logits - reference(ids).logits).abs().max().item()}


# ------------------------------------------------------------------------------------------------ Lightning

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj",
                                                   "down_proj"]}
DECODER = {"hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_size": 32}
CLIP = 0.05  # small enough to clip most steps: the strategy's global norm over DTensor gradients


def lightning_classes():
    import lightning.pytorch as pl

    from lightning_peft.modules import CausalLM

    class SGDCausalLM(CausalLM):
        """CausalLM with plain SGD (no schedule), so a plain loop can reproduce its training exactly."""

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)

    class Seed(pl.Callback):
        """Seeds right before the LoRA callback injects (it comes first in the list), as the reference does."""

        def setup(self, trainer, pl_module, stage):
            torch.manual_seed(123)

    return SGDCausalLM, Seed


def token_data(n: int = 16) -> torch.utils.data.TensorDataset:
    ids = torch.randint(0, 32, (n, 8), generator=torch.Generator().manual_seed(9))
    return torch.utils.data.TensorDataset(ids)


def collate(rows):
    return {"input_ids": torch.stack([r[0] for r in rows])}


def reference_run(epochs: int, batch_size: int) -> nn.Module:
    """The single-process plain loop the Trainer runs must equal."""
    sgd_lm, _ = lightning_classes()
    torch.manual_seed(0)
    module = sgd_lm(vocab_size=32, decoder=DECODER)
    torch.manual_seed(123)
    inject_lora(module, **LORA)
    opt = module.configure_optimizers()
    loader = torch.utils.data.DataLoader(token_data(), batch_size=batch_size, collate_fn=collate)
    for _ in range(epochs):
        for i, batch in enumerate(loader):
            module.training_step(batch, i).backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    return module


def fit(out: Path, epochs: int, batch_size: int, ckpt_path: Path | None = None, adapter_only: bool = False,
        **strategy_args):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_peft.callbacks import LoRA, MergeOnSave
    from lightning_peft.strategies import TensorParallelStrategy

    sgd_lm, seed = lightning_classes()
    torch.manual_seed(0)
    module = sgd_lm(vocab_size=32, decoder=DECODER)
    strategy = TensorParallelStrategy(**strategy_args)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, gradient_clip_val=CLIP, logger=False,
        enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out, use_distributed_sampler=False,
        callbacks=[seed(), LoRA(**LORA, adapter_only_checkpoint=adapter_only), MergeOnSave(dirpath=str(out / "export")),
                   ModelCheckpoint(dirpath=out / "ckpt", save_last=True)],
    )
    # Lightning's own sampler would shuffle: unshuffled, round-robin over the data-parallel replicas instead (the
    # mesh is (data_parallel, tensor_parallel), row-major), so the replicas see the reference's batches together.
    tp = strategy_args["tensor_parallel_size"]
    sampler = torch.utils.data.DistributedSampler(token_data(), num_replicas=2 // tp, rank=RANK // tp, shuffle=False)
    loader = torch.utils.data.DataLoader(token_data(), batch_size=batch_size, collate_fn=collate, sampler=sampler)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return module, strategy


def section_trainer(out: Path, mesh) -> dict:
    from lightning_peft.parallel.dtensor import local_parameter_bytes

    result: dict = {}
    reference = reference_run(epochs=2, batch_size=4)
    straight, strategy = fit(out / "straight", epochs=2, batch_size=4, tensor_parallel_size=2)
    straight_strategy = strategy
    result["plan"] = strategy.applied_plan
    result["trainer_error"] = max_error(reference, straight)
    result["trainer_moved"] = max_error(reference, reference_run(epochs=0, batch_size=4))
    result["bytes"] = (local_parameter_bytes(straight), local_parameter_bytes(reference))
    if RANK == 0:
        from safetensors.torch import load_file

        saved = load_file(out / "straight" / "export" / "adapter" / "adapter_model.safetensors")
        params = dict(reference.named_parameters())
        result["export_error"] = max(
            (tensor - params[key.removeprefix("base_model.model.").replace(".weight", ".default.weight")])
            .abs().max().item() for key, tensor in saved.items()
        )
        result["export_keys"] = len(saved)
    # Resume: one epoch, then a second one from the checkpoint, equals two epochs straight.
    fit(out / "first", epochs=1, batch_size=4, tensor_parallel_size=2)
    resumed, _ = fit(out / "resumed", epochs=2, batch_size=4, ckpt_path=out / "first" / "ckpt" / "last.ckpt",
                     tensor_parallel_size=2)
    result["resume_error"] = max_error(straight, resumed)
    # Data parallel only (dp=2, tp=1): each rank half of the joint batch of the reference; one epoch, then the second
    # from an adapter-only checkpoint (the frozen base absent from it).
    fit(out / "dp_first", epochs=1, batch_size=2, adapter_only=True, tensor_parallel_size=1)
    replicas, strategy = fit(out / "dp", epochs=2, batch_size=2, ckpt_path=out / "dp_first" / "ckpt" / "last.ckpt",
                             adapter_only=True, tensor_parallel_size=1)
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(out / "dp_first" / "ckpt" / "last.ckpt").read_metadata()
    result["dp_checkpoint_keys"] = sorted(k for k in metadata.state_dict_metadata if k.startswith("state_dict."))
    result["dp_sizes"] = (strategy.data_parallel_size, strategy.tensor_parallel_size)
    result["dp_error"] = max_error(reference, replicas)
    from lightning_peft._seams import data_parallel

    result["seams"] = {"dp": data_parallel(strategy), "tp": data_parallel(straight_strategy)}
    return result


# Each replica's batches use one adapter ("a" on rank 0, "b" on rank 1); "c" is used by none.
ADAPTERS = {name: {"rank": 2, "alpha": 4.0, "target_modules": ["q_proj", "v_proj"]} for name in ("a", "b", "c")}


def routed_data(n: int = 16) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(token_data(n).tensors[0], torch.arange(n))


def routed_collate(rows):
    return {"input_ids": torch.stack([r[0] for r in rows]), "adapter": ["ab"[int(r[1]) % 2] for r in rows]}


def multilora_fit(out: Path, devices: int):
    """CausalLM + MultiLoRA + AdamW (weight decay: a zero gradient would move a parameter, no gradient does not):
    (dp=2, tp=1) on 2 ranks with batches of 2, or one process on the joint batches of 4 (the same rows)."""
    import lightning.pytorch as pl

    from lightning_peft.callbacks import MultiLoRA
    from lightning_peft.modules import CausalLM
    from lightning_peft.strategies import TensorParallelStrategy

    _, seed = lightning_classes()

    class AdamCausalLM(CausalLM):
        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)

    torch.manual_seed(0)
    module = AdamCausalLM(vocab_size=32, decoder=DECODER)
    data = routed_data()
    if devices == 2:
        strategy = TensorParallelStrategy(tensor_parallel_size=1)
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=RANK, shuffle=False)
        loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=routed_collate, sampler=sampler)
    else:
        strategy = "auto"
        loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=routed_collate)
    def trainable() -> dict[str, torch.Tensor]:
        return {n: full(p).detach().clone() for n, p in module.named_parameters() if p.requires_grad}

    class Initial(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.values = trainable()

    initial = Initial()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=out, use_distributed_sampler=False,
                         callbacks=[seed(), MultiLoRA(ADAPTERS, modules_to_save=[]), initial])
    trainer.fit(module, train_dataloaders=loader)
    return trainable(), initial.values


def section_multilora(out: Path, mesh) -> dict:
    """Suspected defect 14: replicas that route different adapters average their gradients as DDP would."""
    replicas, initial = multilora_fit(out / "multilora_dp", devices=2)
    reference, _ = multilora_fit(out / "multilora_single", devices=1)
    return {"replicas": replicas, "reference": reference, "initial": initial}


SECTIONS = ["pure", "peft", "trainer", "multilora"]


def run(out: Path) -> None:
    """The job ``tensor_parallel`` of ``tests/_two_ranks.py``: every section, in the process group it joins (or
    starts)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for section in SECTIONS:
        result = globals()[f"section_{section}"](out, mesh)
        torch.save(result, out / f"{section}-rank{RANK}.pt")
    dist.barrier()


if __name__ == "__main__":
    run(Path(sys.argv[1]))
    dist.destroy_process_group()
    exit_worker()
