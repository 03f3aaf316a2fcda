"""Run by tests/strategies/test_pipeline.py on 2 ranks (gloo): PipelineStrategy fits, checked against one process.

Usage: ``python pp_script.py OUT_DIR`` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK / NODE_RANK set
(the test starts both ranks). Several fits share one process group. Each rank writes ``OUT_DIR/<case>-rank<N>.pt``:
what it measured and the single-process reference it computed itself, so the test compares the two.
"""

from __future__ import annotations


import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_peft._seams import refuse_together  # noqa: E402
from lightning_peft.callbacks import LoRA, MergeOnSave  # noqa: E402
from lightning_peft.modules import CausalLM  # noqa: E402
from lightning_peft.strategies.pipeline import PipelineStrategy, consolidate_checkpoint  # noqa: E402
from tests.strategies._launch import exit_worker  # noqa: E402

warnings.filterwarnings("ignore")
DECODER = {"hidden_size": 16, "num_layers": 4, "num_heads": 2, "ffn_size": 32, "max_position_embeddings": 16}
VOCAB = 40
BATCH, LENGTH = 8, 6


def make_model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(vocab_size=VOCAB, decoder=DECODER, learning_rate=1e-2, warmup_fraction=0.0)


def make_batches(n: int, padded: bool) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
        mask = torch.ones_like(ids)
        if padded:
            mask[1, 4:] = 0
            mask[6, 3:] = 0
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


class Batches(torch.utils.data.Dataset):
    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(BATCH)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def loader(batches: list[dict[str, torch.Tensor]]) -> DataLoader:
    return DataLoader(Batches(batches), batch_size=BATCH, shuffle=False)


class Grabber(Callback):
    """Records every rank's own (non-meta) gradients before the first optimizer step, and the logged loss."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.grads:
            self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters()
                          if p.device.type != "meta" and p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def trainer(out: Path, strategy: PipelineStrategy, callbacks=(), **kwargs) -> pl.Trainer:
    options = {"max_steps": 1, "limit_val_batches": 0, "logger": False, "enable_progress_bar": False,
               "enable_model_summary": False, "enable_checkpointing": False, "use_distributed_sampler": False, **kwargs}
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, default_root_dir=out,
                      callbacks=list(callbacks), **options)


def reference_gradients(
    batches: list[dict[str, torch.Tensor]], microbatches: int
) -> tuple[float, dict[str, torch.Tensor]]:
    """One process: the first batch's mean micro-batch loss of CausalLM.training_step, and the gradient of the mean
    of that over ``batches`` (gradient accumulation)."""
    model = make_model()
    size = BATCH // microbatches
    means = [torch.stack([model.training_step({k: v[i * size:(i + 1) * size] for k, v in batch.items()}, 0)
                          for i in range(microbatches)]).mean() for batch in batches]
    torch.stack(means).mean().backward()
    return float(means[0]), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def own_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items() if v.device.type != "meta"}


def case_gradients(out: Path, rank: int) -> None:
    """Loss and gradients of every schedule equal one process (padded batch: the mask travels between stages)."""
    batches = make_batches(1, padded=True)
    results = {}
    for name, strategy in {
        "gpipe": PipelineStrategy(num_stages=2, schedule="gpipe", num_microbatches=4),
        "1f1b": PipelineStrategy(num_stages=2, schedule="1f1b", num_microbatches=4, split_points=["layers.2"]),
        "interleaved_1f1b": PipelineStrategy(num_stages=4, schedule="interleaved_1f1b", num_microbatches=4),
        "1f1b_m2": PipelineStrategy(num_stages=2, schedule="1f1b", num_microbatches=2),
        "1f1b_accumulate": PipelineStrategy(num_stages=2, schedule="1f1b", num_microbatches=2),
    }.items():
        grab = Grabber()
        model = make_model()
        accumulate = 2 if name == "1f1b_accumulate" else 1
        data = make_batches(2, padded=True) if accumulate > 1 else batches
        t = trainer(out, strategy, [grab], limit_val_batches=None, accumulate_grad_batches=accumulate)
        t.fit(model, loader(data))
        ref_loss, ref_grads = reference_gradients(data, strategy.num_microbatches)
        results[name] = {"loss": grab.losses[0], "grads": grab.grads, "ref_loss": ref_loss,
                         "ref_grads": {n: ref_grads[n] for n in grab.grads}, "stages": strategy._split_names}
        if name == "interleaved_1f1b":  # evaluation through the interleaved stages, batches of 3, 3 and 2
            val = DataLoader(Batches(make_batches(1, padded=True)), batch_size=3, shuffle=False)
            t.validate(model, val, verbose=False)
            results[name]["val"] = {k: float(t.callback_metrics[k]) for k in ("val_loss", "val_ppl")}
            with t.strategy.gathered_parameters(model):
                state = [dict(model.state_dict()) if rank == 0 else None]
            dist.broadcast_object_list(state, src=0)
            unsplit = make_model()
            unsplit.load_state_dict(state[0])
            # On both ranks: torchmetrics syncs its states over the process group even in a one-device Trainer.
            ts, _ = single_process(unsplit, out / "single-val", val, fn="validate", verbose=False)
            results[name]["ref_val"] = {k: float(ts.callback_metrics[k]) for k in ("val_loss", "val_ppl")}
    torch.save(results, out / f"gradients-rank{rank}.pt")


def case_resume(out: Path, rank: int) -> None:
    """A checkpoint save -> resume equals a straight run; the checkpoint reloads into the unsplit model."""
    batches = make_batches(2, padded=False)

    def fit(root: str, ckpt_path=None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        model = make_model()
        callbacks = [ModelCheckpoint(dirpath=out / root, save_top_k=-1, every_n_epochs=1)]
        t = trainer(out / root, PipelineStrategy(num_stages=2, num_microbatches=2), callbacks, max_steps=-1,
                    max_epochs=2, enable_checkpointing=True)
        t.fit(model, loader(batches), ckpt_path=ckpt_path)
        with t.strategy.gathered_parameters(model):
            full = {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else None
        return own_state(model), full

    straight, straight_full = fit("straight")  # two epochs, a checkpoint after each
    first = out / "straight" / "epoch=0-step=2.ckpt"
    resumed, _ = fit("resumed", ckpt_path=str(first))
    result = {"straight": straight, "resumed": resumed}
    if rank == 0:
        merged = consolidate_checkpoint(first)
        unsplit = make_model()
        unsplit.load_state_dict(merged["state_dict"])  # strict: every key of the unsplit model is there
        torch.save(merged, out / "merged.ckpt")
        # The merged checkpoint resumes on one process: its second epoch equals the pipeline's.
        single = make_model()
        t = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, default_root_dir=out / "single")
        t.fit(single, loader(batches), ckpt_path=str(out / "merged.ckpt"))
        result.update(straight_full=straight_full, single_resumed=dict(single.state_dict()),
                      stage_files=sorted(p.name for p in first.iterdir()))
    dist.barrier()
    # The merged, unsplit file resumes into the pipeline too: each rank takes its weights and optimizer states.
    result["from_merged"], _ = fit("from_merged", ckpt_path=str(out / "merged.ckpt"))
    torch.save(result, out / f"resume-rank{rank}.pt")


def case_lora_export(out: Path, rank: int) -> None:
    """LoRA injected before the split; MergeOnSave writes the full adapter and merged model from rank 0."""
    batches = make_batches(1, padded=False)
    model = make_model()
    export = MergeOnSave(dirpath=str(out / "export"))
    lora = LoRA(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"], init="gaussian")
    t = trainer(out / "lora", PipelineStrategy(num_stages=2, schedule="gpipe", num_microbatches=2), [lora, export],
                max_steps=2)
    t.fit(model, loader(batches))
    trainable = {n: p.detach().clone() for n, p in model.named_parameters()
                 if p.requires_grad and p.device.type != "meta"}
    with t.strategy.gathered_parameters(model):
        full = {n: p.detach().clone() for n, p in model.named_parameters()} if rank == 0 else None
    torch.save({"trainable": trainable, "full": full, "exported": sorted(getattr(export, "last_export", {}) or {})},
               out / f"lora_export-rank{rank}.pt")


class AllParameters(CausalLM):
    """An optimizer over every parameter, frozen ones included, as many projects build it."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Seed(Callback):
    """Seeds as the callbacks' setup begins (put first): adapters injected after it start alike on every strategy."""

    def setup(self, trainer, pl_module, stage) -> None:
        torch.manual_seed(0)


def case_empty_stage(out: Path, rank: int) -> None:
    """LoRA on the second stage's layers only: the first stage trains nothing (its optimizer holds only frozen
    weights) and still passes activations and gradients; the adapters equal one process. Then a refusal found on
    one rank only is raised on both (refuse_together), instead of leaving the other in its next collective."""
    def fit(strategy, root: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = AllParameters(vocab_size=VOCAB, decoder=DECODER, learning_rate=1e-2, warmup_fraction=0.0)
        lora = LoRA(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"], layers_to_transform=[2, 3],
                    init="gaussian")
        data = loader(make_batches(2, padded=False))
        if strategy is None:
            single_process(model, out / root, data, callbacks=[Seed(), lora], max_steps=2)
        else:
            trainer(out / root, strategy, [Seed(), lora], max_steps=2).fit(model, data)
        return {n: p.detach().clone() for n, p in model.named_parameters()
                if p.requires_grad and p.device.type != "meta"}

    result = {"trained": fit(PipelineStrategy(num_stages=2, num_microbatches=2, split_points=["layers.2"]), "empty"),
              "single": fit(None, "empty-single")}
    try:
        refuse_together(ValueError("only rank 1 found this") if rank == 1 else None)
    except ValueError as error:
        result["refused"] = str(error)
    torch.save(result, out / f"empty_stage-rank{rank}.pt")


def single_process(model: pl.LightningModule, out: Path, data, fn: str = "fit", verbose: bool = True, **kwargs):
    t = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False, default_root_dir=out, **kwargs)
    result = getattr(t, fn)(model, data) if fn == "fit" else getattr(t, fn)(model, data, verbose=verbose)
    return t, result


def case_clip_tied(out: Path, rank: int) -> None:
    """Tied input/output embeddings (on both ranks, gradients summed), clipping by the global norm, a short last batch
    (2 rows: 2 micro-batches instead of 4, under GPipe): three steps equal one process; then validation (a short
    last batch too) logs the same val_loss / val_ppl on both ranks as one process."""
    batches = make_batches(2, padded=False)
    short = {k: v[:2] for k, v in make_batches(3, padded=False)[2].items()}
    data = Batches(batches)
    data.rows += [{k: v[i] for k, v in short.items()} for i in range(2)]
    train = DataLoader(data, batch_size=BATCH, shuffle=False)
    val = DataLoader(Batches(make_batches(1, padded=True)), batch_size=3, shuffle=False)  # batches of 3, 3, 2

    def build() -> CausalLM:
        torch.manual_seed(0)
        return CausalLM(vocab_size=VOCAB, decoder={**DECODER, "tie_word_embeddings": True}, learning_rate=1e-2,
                        warmup_fraction=0.0)

    model = build()
    t = trainer(out / "tied", PipelineStrategy(num_stages=2, schedule="1f1b", num_microbatches=4), max_steps=-1,
                max_epochs=1, gradient_clip_val=0.05, limit_val_batches=None)
    t.fit(model, train, val)
    metrics = {k: float(v) for k, v in t.callback_metrics.items()}
    with t.strategy.gathered_parameters(model):
        full = {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else None
    single = build()
    ts, _ = single_process(single, out / "tied-single", train, max_epochs=1, gradient_clip_val=0.05)
    ts.validate(single, val, verbose=False)
    torch.save({"metrics": metrics, "full": full, "single": dict(single.state_dict()),
                "single_metrics": {k: float(v) for k, v in ts.callback_metrics.items()},
                "shared": [n for n, p in model.named_parameters() if p.device.type != "meta"]},
               out / f"clip_tied-rank{rank}.pt")


class _Sleep(torch.autograd.Function):
    """Identity that takes ``seconds`` forward and twice that backward: a stage of known cost."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        __import__("time").sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        __import__("time").sleep(2 * ctx.seconds)
        return grad, None


class Slow(torch.nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear, self.seconds = torch.nn.Linear(4, 4), seconds

    def forward(self, x):
        return _Sleep.apply(self.linear(x), self.seconds)


class SlowRegression(pl.LightningModule):
    """An nn.Sequential of two stages of known cost; batches are (x, y) tuples."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(Slow(seconds), Slow(seconds))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, batch_size=x.shape[0])
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StepTimes(Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        seconds = torch.tensor(trainer.strategy.last_step_seconds, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the pipeline's step: first forward to last backward
        self.seconds.append(float(seconds))


def case_bubble(out: Path, rank: int) -> None:
    """Measured idle share of a step (stage forward 30 ms, backward 60 ms) against (p - 1) / (m + p - 1)."""
    seconds, results = 0.03, {}
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=generator), torch.randn(32, 4, generator=generator)
    data = torch.utils.data.TensorDataset(x, y)
    for schedule, m in (("gpipe", 1), ("gpipe", 2), ("gpipe", 4), ("1f1b", 4), ("1f1b", 8)):
        times = StepTimes()
        strategy = PipelineStrategy(num_stages=2, schedule=schedule, num_microbatches=m)
        trainer(out / "bubble", strategy, [times], max_steps=4).fit(SlowRegression(seconds), DataLoader(data, 8))
        step = min(times.seconds[1:])  # the first step also infers shapes; the least of 3 is the least disturbed
        busy = m * 3 * seconds  # this rank's one stage: m forwards and m backwards
        results[f"{schedule}-{m}"] = {"measured": 1 - busy / step, "predicted": strategy.bubble_fraction()}
    torch.save(results, out / f"bubble-rank{rank}.pt")


def case_scaler(out: Path, rank: int) -> None:
    """16-mixed with a GradScaler (explicit: on the CPU Lightning turns "16-mixed" into bf16 without one): the unscaled
    gradients equal one process's, which scales the loss, differentiates and unscales (autocast on the CPU: float16)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    batches = make_batches(1, padded=True)
    grab, model = Grabber(), make_model()
    precision = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    t = trainer(out / "scaler", PipelineStrategy(num_stages=2, schedule="1f1b", num_microbatches=4), [grab],
                plugins=[precision], max_steps=2)
    t.fit(model, loader(batches * 2))
    reference = make_model()
    scaler = torch.amp.GradScaler("cpu")
    size = BATCH // 4
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        losses = [reference.training_step({k: v[i * size:(i + 1) * size] for k, v in batches[0].items()}, 0)
                  for i in range(4)]
    scaler.scale(torch.stack(losses).mean()).backward()
    ref_grads = {n: p.grad / scaler.get_scale() for n, p in reference.named_parameters() if p.grad is not None}
    torch.save({"grads": grab.grads, "ref_grads": {n: ref_grads[n] for n in grab.grads},
                "scale": precision.scaler.get_scale(), "stepped": own_state(model), "initial": own_state(make_model())},
               out / f"scaler-rank{rank}.pt")


class Counting(CausalLM):
    """A module as many projects write it: a counter and a torchmetrics metric updated in training_step, values
    logged with reduce_fx="sum" and sync_dist=True, a mean logged without batch_size (Lightning infers it)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB, decoder=DECODER, learning_rate=1e-2, warmup_fraction=0.0)
        from torchmetrics import SumMetric

        self.train_rows = SumMetric()
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        self.train_rows.update(batch["input_ids"].shape[0])
        self.log("train_rows", self.train_rows, on_step=False, on_epoch=True)
        mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
        self.log("train_tokens", mask.sum().float(), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        mask = batch["attention_mask"]
        self.log("val_mean_length", mask.sum(1).float().mean())
        self.log("val_tokens", mask.sum().float(), reduce_fx="sum", sync_dist=True)


class ListOfBatches(torch.utils.data.Dataset):
    def __init__(self, batches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


class Schedules(Callback):
    """The most schedules the strategy held at once."""

    most = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.most = max(self.most, len(trainer.strategy._schedules))


def case_logging(out: Path, rank: int) -> None:
    """Logged epoch metrics equal one process (sum summed, mean weighted by samples: validation batches of 3, 3, 2);
    training_step runs once per micro-batch, never on the schedule's shape inference; batches of 5 lengths under
    max_schedules=2 keep at most 2 schedules and train as one process does."""
    train = loader(make_batches(2, padded=True))
    val = DataLoader(Batches(make_batches(1, padded=True)), batch_size=3, shuffle=False)  # batches of 3, 3, 2
    keys = ("train_rows", "train_tokens", "val_mean_length", "val_tokens")  # the data's, not the training's
    model = Counting()
    t = trainer(out / "logging", PipelineStrategy(num_stages=2, schedule="1f1b", num_microbatches=4), max_steps=-1,
                max_epochs=1, limit_val_batches=None, num_sanity_val_steps=0)
    t.fit(model, train, val)
    single = Counting()
    single.train_rows.sync_on_compute = single.train_rows._to_sync = False  # both ranks run this reference
    ts, _ = single_process(single, out / "logging-single", train, max_epochs=1)
    single_metrics = {k: float(v) for k, v in ts.callback_metrics.items()}
    ts.validate(single, val, verbose=False)
    single_metrics.update({k: float(v) for k, v in ts.callback_metrics.items()})
    result = {"metrics": {k: float(t.callback_metrics[k]) for k in keys}, "calls": model.calls,
              "single": {k: single_metrics[k] for k in keys}}
    generator = torch.Generator().manual_seed(2)
    lengths = [3, 5, 4, 6, 3, 7]
    padded = [{"input_ids": torch.randint(1, VOCAB, (BATCH, n), generator=generator)} for n in lengths]
    dynamic = DataLoader(ListOfBatches(padded), batch_size=None)
    grab, model, cached = Grabber(), Counting(), Schedules()
    strategy = PipelineStrategy(num_stages=2, schedule="gpipe", num_microbatches=2, max_schedules=2)
    trainer(out / "dynamic", strategy, [grab, cached], max_steps=-1, max_epochs=1).fit(model, dynamic)
    single_grab, single = Grabber(), Counting()
    single_process(single, out / "dynamic-single", dynamic, max_epochs=1, callbacks=[single_grab])
    result.update(schedules=cached.most, dynamic_calls=model.calls, losses=grab.losses,
                  single_losses=single_grab.losses)
    torch.save(result, out / f"logging-rank{rank}.pt")


class BatchNormRegression(pl.LightningModule):
    """An nn.Sequential with a BatchNorm on each stage (split at "3"); batches are (x, y) tuples."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
            torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def case_buffers(out: Path, rank: int) -> None:
    """BatchNorm statistics: each stage's, in the consolidated checkpoint and gathered on rank 0, equal one process
    running the same micro-batches (none from the schedule's shape inference, none from a rank that never ran them)."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)
    model = BatchNormRegression()
    t = trainer(out / "buffers", PipelineStrategy(num_stages=2, schedule="gpipe", num_microbatches=4,
                                                  split_points=["3"]), max_steps=2)
    t.fit(model, DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
    t.save_checkpoint(out / "buffers.ckpt")
    with t.strategy.gathered_parameters(model):
        gathered = {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else None
    reference = BatchNormRegression()
    optimizer = reference.configure_optimizers()
    for step in range(2):
        xs, ys = x[step * 8:(step + 1) * 8], y[step * 8:(step + 1) * 8]
        losses = [reference.training_step((xs[i * 2:(i + 1) * 2], ys[i * 2:(i + 1) * 2]), 0) for i in range(4)]
        torch.stack(losses).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    merged = consolidate_checkpoint(out / "buffers.ckpt")["state_dict"] if rank == 0 else None
    torch.save({"merged": merged, "gathered": gathered, "reference": dict(reference.state_dict())},
               out / f"buffers-rank{rank}.pt")


CASES = ["gradients", "resume", "lora_export", "empty_stage", "clip_tied", "bubble", "scaler", "logging", "buffers"]


def run(out: Path) -> None:
    """The job ``pipeline`` of ``tests/_two_ranks.py``: every case."""
    rank = int(__import__("os").environ["RANK"])
    for case in CASES:
        globals()[f"case_{case}"](out, rank)


if __name__ == "__main__":
    run(Path(sys.argv[1]))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    exit_worker()
