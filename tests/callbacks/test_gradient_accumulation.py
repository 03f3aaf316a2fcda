"""GradientAccumulation under a real Trainer: exact windows in float64, equal to a plain loop, resumable, and refusals."""

from __future__ import annotations

import csv
import logging
import math
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from lightning_peft.callbacks import GradientAccumulation, GradientNoise, LoRA
from lightning_peft.peft import adapter_state_dict, inject_lora
from lightning_peft.training import AccumulationSchedule, add_gradient_noise, noise_variance, parameter_generator

from tests._models import LORA_ARGS, Classifier, loader, trainer


class Regression(pl.LightningModule):
    """A linear model with a mean-squared-error loss: small enough to compare gradients in float64."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.linear(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Estimating(Regression):
    """Records what an LR schedule would see in configure_optimizers.

    Asking for ``estimated_stepping_batches`` there loads the train loader before the checkpoint's loader state is
    restored, which Lightning then never applies (Lightning issue 20550); the callbacks' ``RNGState`` applies it
    (a mid-epoch resume with such a schedule: ``tests/callbacks/test_lora.py``).
    """

    def configure_optimizers(self):
        self.estimated = self.trainer.estimated_stepping_batches
        self.total = GradientAccumulation.total_steps(self.trainer)
        self.count_at_configure = self.trainer.accumulate_grad_batches
        return super().configure_optimizers()


class Stream:
    """The same micro-batches without a len(): Lightning sees an epoch of unknown length."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class ResumableLoader:
    """Micro-batches that resume mid-epoch where a checkpoint left them (Lightning calls state_dict/load_state_dict)."""

    def __init__(self, batches) -> None:
        self.batches, self.yielded, self.skip = batches, 0, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        start, self.skip = self.skip, 0
        for index in range(start, len(self.batches)):
            self.yielded = index + 1
            yield self.batches[index]

    def state_dict(self):
        return {"trained": self.yielded}  # with a len(), Lightning fetches no micro-batch ahead

    def load_state_dict(self, state) -> None:
        self.skip = state["trained"]


class CaptureSteps(Callback):
    """Each optimizer step's parameters (before the step), gradients and window size."""

    def __init__(self) -> None:
        self.steps = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        weight, bias = pl_module.linear.weight, pl_module.linear.bias
        self.steps.append((weight.detach().clone(), bias.detach().clone(), weight.grad.clone(), bias.grad.clone(),
                           trainer.accumulate_grad_batches))


def regression_batches():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(30, 5, dtype=torch.float64, generator=generator)
    y = torch.randn(30, 2, dtype=torch.float64, generator=generator)
    return x, y, list(zip(x.split(3), y.split(3)))  # 10 micro-batches of 3


def regression_data():
    x, y, _ = regression_batches()
    return DataLoader(TensorDataset(x.float(), y.float()), batch_size=3)


@pytest.mark.parametrize(("schedule", "sized", "sizes"), [
    (4, True, [4, 4, 2]),
    ({0: 1, 1: 3}, True, [1, 3, 3, 3]),  # windows start at micro-batches 1, 4, 7: no multiple of 3
    (4, False, [4, 4, 2]),  # the stream ends inside the third window
    ({0: 3, 2: 5}, False, [3, 3, 4]),
])
def test_each_step_has_the_gradient_of_one_batch_as_large_as_its_window(schedule, sized, sizes, tmp_path):
    x, y, batches = regression_batches()
    capture = CaptureSteps()
    data = DataLoader(TensorDataset(x, y), batch_size=3) if sized else Stream(batches)
    trainer(tmp_path, max_epochs=1, precision="64-true", callbacks=[GradientAccumulation(schedule), capture]).fit(
        Regression(), data)
    assert [step[-1] for step in capture.steps] == sizes
    start = 0
    for weight, bias, weight_grad, bias_grad, size in capture.steps:
        linear = nn.Linear(5, 2, dtype=torch.float64)
        linear.weight.data, linear.bias.data = weight, bias
        nn.functional.mse_loss(linear(x[3 * start:3 * (start + size)]), y[3 * start:3 * (start + size)]).backward()
        torch.testing.assert_close(weight_grad, linear.weight.grad, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(bias_grad, linear.bias.grad, rtol=1e-12, atol=1e-14)
        start += size


def logged(tmp_path, name):
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as file:
        return [float(row[name]) for row in csv.DictReader(file) if row.get(name)]


def test_lora_noise_and_a_schedule_that_changes_mid_epoch_equal_a_plain_loop(tiny_bert_config, tmp_path):
    """{0: 1, 1: 2} over 2 epochs of 4 micro-batches: windows 1, 2, 1 | 2, 2; the noise is added once per step."""
    torch.manual_seed(0)
    module = Classifier(tiny_bert_config, lr=0.01)
    base = {k: v.clone() for k, v in module.model.state_dict().items()}
    initial = {}

    class RecordStart(Callback):
        def on_fit_start(self, trainer, pl_module):
            initial.update({k: v.clone() for k, v in adapter_state_dict(pl_module.model).items()})

    callbacks = [LoRA(**LORA_ARGS), GradientAccumulation({0: 1, 1: 2}), GradientNoise(eta=0.3, seed=7), RecordStart()]
    trainer(tmp_path, max_epochs=2, logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=callbacks).fit(
        module, loader())
    assert logged(tmp_path, "grad_accumulation") == [1, 2, 1, 2, 2]
    expected_std = [math.sqrt(noise_variance(t, 0.3)) for t in range(5)]  # once per step, with t = the step
    assert logged(tmp_path, "grad_noise_std") == pytest.approx(expected_std, rel=1e-6)

    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification(tiny_bert_config)
    model.load_state_dict(base)
    inject_lora(model, **LORA_ARGS)
    model.load_state_dict(initial, strict=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.01)
    model.train()
    schedule, step = AccumulationSchedule({0: 1, 1: 2}), 0
    for _ in range(2):
        for micro in schedule.micro_batches(list(loader()), start_step=step):
            ids, labels = micro.batch
            (model(input_ids=ids, labels=labels).loss / micro.window_size).backward()
            if micro.last:
                for index, param in enumerate(params):  # each parameter draws from its own generator
                    add_gradient_noise([param], micro.step, 0.3, generator=parameter_generator(7, micro.step, index))
                optimizer.step()
                optimizer.zero_grad()
                step = micro.step + 1
    assert step == 5
    ours, plain = adapter_state_dict(module.model), adapter_state_dict(model)
    for key in plain:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-6, atol=1e-7)
    head = "classifier.trained_module.weight"
    assert not torch.equal(ours[head], initial[head])


def test_target_global_batch_derives_the_count_before_configure_optimizers(tmp_path, caplog):
    module = Estimating()
    x, y, _ = regression_batches()
    run = trainer(tmp_path, max_epochs=2, precision="64-true", callbacks=[GradientAccumulation(global_batch_size=12)])
    with caplog.at_level(logging.INFO):
        run.fit(module, DataLoader(TensorDataset(x, y), batch_size=3))  # 10 micro-batches of 3: windows 4, 4, 2
    assert "GradientAccumulation: global batch 12 = micro-batch 3 x 1 data-parallel replica(s) x 4 accumulated micro-batches" in (
        caplog.text)
    assert module.count_at_configure == 4
    assert module.estimated == module.total == run.global_step == 6
    assert run.accumulate_grad_batches == 1  # given back at teardown
    assert "_accumulated_batches_reached" not in vars(run.fit_loop.epoch_loop)
    assert "_make_zero_grad_fn" not in vars(run.fit_loop.epoch_loop.automatic_optimization)


def test_a_changing_schedule_logs_and_reports_its_exact_step_count(tmp_path, caplog):
    run = trainer(tmp_path, max_epochs=2, callbacks=[GradientAccumulation({0: 1, 1: 3})])
    module = Estimating()
    with caplog.at_level(logging.INFO):
        run.fit(module, regression_data())  # windows 1, 3, 3, 3 | 3, 3, 3, 1
    assert module.total == run.global_step == 8
    assert module.estimated == 20 and module.count_at_configure == 1  # Lightning's estimate uses the smallest count
    assert ("GradientAccumulation: the schedule {0: 1, 1: 3} gives 8 optimizer steps in this run; "
            "trainer.estimated_stepping_batches (20) assumes the count 1 throughout") in caplog.text
    capped = trainer(tmp_path, max_epochs=2, max_steps=5, callbacks=[GradientAccumulation({0: 1, 1: 3})])
    capped.fit(module := Estimating(), regression_data())
    assert module.total == capped.global_step == 5
    trainer(tmp_path, max_epochs=2).fit(module := Estimating(), regression_data())
    assert module.total == module.estimated == 20  # without the callback: Lightning's own estimate


def fit_resumable(config, tmp_path, ckpt_path=None):
    torch.manual_seed(0)
    module = Classifier(config)
    checkpoints = [ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1),
                   ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)]
    callbacks = [LoRA(**LORA_ARGS), GradientAccumulation({0: 1, 1: 2}), *checkpoints]
    trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=callbacks).fit(
        module, ResumableLoader(list(loader())), ckpt_path=ckpt_path)
    return module


def test_a_resumed_run_equals_the_straight_run(tiny_bert_config, tmp_path):
    """Windows 1, 2, 1 | 2, 2: ``step=2`` is saved before micro-batch 3 (a window of 1 left), ``epoch=0`` after it."""
    straight = fit_resumable(tiny_bert_config, tmp_path / "straight")
    assert torch.load(tmp_path / "straight" / "step=2.ckpt", weights_only=False)["loops"]["fit_loop"][
        "epoch_loop.batch_progress"]["current"]["ready"] == 3  # mid-epoch: 3 of 4 micro-batches done
    reference = adapter_state_dict(straight.model)
    for name in ("step=2.ckpt", "epoch=0.ckpt"):
        resumed = fit_resumable(tiny_bert_config, tmp_path / name, ckpt_path=tmp_path / "straight" / name)
        ours = adapter_state_dict(resumed.model)
        for key in reference:
            assert torch.equal(ours[key], reference[key]), (name, key)


class SaveAfter(Callback):
    def __init__(self, path, batch_idx) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


def test_a_run_resumed_inside_a_window_keeps_its_windows_and_averages_over_what_is_left(tmp_path):
    """Windows 1, 3, 3, 3 (micro-batches 0 | 1-3 | 4-6 | 7-9), saved after micro-batch 4: the run goes on with 6 as the
    end of the window 4-6, not with a new window 5-7. Micro-batch 4's gradient is not in the checkpoint, so that step
    is the mean over micro-batches 5 and 6 (each divided by 2, not by 3: the old code stepped with 2/3 of a mean)."""
    _, _, batches = regression_batches()
    callbacks = [GradientAccumulation({0: 1, 1: 3}), SaveAfter(tmp_path / "mid.ckpt", 4)]
    trainer(tmp_path, max_epochs=1, precision="64-true", callbacks=callbacks).fit(Regression(), ResumableLoader(batches))
    capture = CaptureSteps()
    resumed = trainer(tmp_path, max_epochs=1, precision="64-true", callbacks=[GradientAccumulation({0: 1, 1: 3}), capture])
    resumed.fit(Regression(), ResumableLoader(batches), ckpt_path=tmp_path / "mid.ckpt")
    assert [step[-1] for step in capture.steps] == [2, 3] and resumed.global_step == 4
    for (weight, bias, weight_grad, bias_grad, size), window in zip(capture.steps, ([5, 6], [7, 8, 9])):
        linear = nn.Linear(5, 2, dtype=torch.float64)
        linear.weight.data, linear.bias.data = weight, bias
        torch.stack([nn.functional.mse_loss(linear(batches[i][0]), batches[i][1]) for i in window]).mean().backward()
        torch.testing.assert_close(weight_grad, linear.weight.grad, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(bias_grad, linear.bias.grad, rtol=1e-12, atol=1e-14)


def test_resuming_with_another_schedule_is_refused(tiny_bert_config, tmp_path):
    fit_resumable(tiny_bert_config, tmp_path / "first")
    run = trainer(tmp_path, max_epochs=3, callbacks=[LoRA(**LORA_ARGS), GradientAccumulation({0: 1, 1: 4})])
    with pytest.raises(ValueError, match=r"GradientAccumulation: the checkpoint was trained with schedule=\{0: 1, "
                                         r"1: 2\}; this run has schedule=\{0: 1, 1: 4\}\. Resume with the checkpoint's"):
        run.fit(Classifier(tiny_bert_config), loader(), ckpt_path=tmp_path / "first" / "epoch=0.ckpt")
    assert run.accumulate_grad_batches == 1 and "_make_zero_grad_fn" not in vars(
        run.fit_loop.epoch_loop.automatic_optimization)  # given back after the failure too


class SelfAccumulatingStrategy(SingleDeviceStrategy):
    """A strategy that, like DeepSpeed, accumulates gradients itself."""

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True


class Manual(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda tmp: trainer(tmp, accumulate_grad_batches=2, callbacks=[GradientAccumulation(4)]), ValueError,
     r"GradientAccumulation: Trainer\(accumulate_grad_batches=2\) is set as well; remove it from the Trainer"),
    (lambda tmp: trainer(tmp, callbacks=[GradientAccumulation(4), GradientAccumulationScheduler({0: 2})]), ValueError,
     r"GradientAccumulation: GradientAccumulationScheduler\(scheduling=\{0: 2\}\) sets the accumulation too; keep one"),
    (lambda tmp: trainer(tmp, strategy=SelfAccumulatingStrategy(torch.device("cpu")),
                         callbacks=[GradientAccumulation({0: 1, 10: 2})]), RuntimeError,
     (r"GradientAccumulation\(schedule=\{0: 1, 10: 2\}\): SelfAccumulatingStrategy accumulates gradients itself "
      r"and reads the count once, at setup, so it cannot change during a run")),
    (lambda tmp: trainer(tmp, callbacks=[GradientAccumulation(global_batch_size=20)]), ValueError,
     (r"GradientAccumulation\(global_batch_size=20\): the global batch size must be a multiple of "
      r"micro_batch_size \* data_parallel_size = 3 \* 1 = 3; the nearest valid global batch sizes are 18 or 21")),
])
def test_conflicting_settings_are_refused_before_training(make, error, match, tmp_path):
    run = make(tmp_path)
    module = Regression()
    with pytest.raises(error, match=match):
        run.fit(module, regression_data())
    assert run.global_step == 0


def test_manual_optimization_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match=r"GradientAccumulation: Manual uses manual optimization, where Lightning "
                                           r"does not accumulate; remove the callback"):
        trainer(tmp_path, callbacks=[GradientAccumulation(2)]).fit(Manual(), regression_data())


def test_target_mode_needs_a_loader_with_a_fixed_batch_size(tmp_path):
    *_, batches = regression_batches()
    with pytest.raises(ValueError, match=r"GradientAccumulation\(global_batch_size=12\): the train dataloader \(Stream\) "
                                         r"has no fixed batch_size to derive the count from"):
        trainer(tmp_path, callbacks=[GradientAccumulation(global_batch_size=12)]).fit(Regression(), Stream(batches))
    with pytest.raises(Exception, match=r"`train_dataloader` must be implemented"):  # Lightning's own check
        trainer(tmp_path, callbacks=[GradientAccumulation(global_batch_size=12)]).fit(Regression())


class BuiltInSetup(Regression):
    """Builds its data in setup(), which Lightning runs after the callbacks' setup."""

    def setup(self, stage):
        self.data = regression_data()

    def train_dataloader(self):
        return self.data


def test_target_mode_reads_a_loader_the_module_builds_in_its_own_setup(tmp_path):
    fit = trainer(tmp_path, max_steps=2, callbacks=[GradientAccumulation(global_batch_size=6)])
    fit.fit(BuiltInSetup())
    assert fit.global_step == 2 and fit.callback_metrics["grad_accumulation"] == 2  # 6 = 3 x 2


def test_a_strategy_that_accumulates_itself_gets_a_constant_count_at_setup(tmp_path):
    module = Estimating()
    run = trainer(tmp_path, max_steps=1, strategy=SelfAccumulatingStrategy(torch.device("cpu")),
                  callbacks=[GradientAccumulation(global_batch_size=6)])
    run.fit(module, regression_data())
    assert module.count_at_configure == 2
    assert "_make_zero_grad_fn" not in vars(run.fit_loop.epoch_loop.automatic_optimization)  # the strategy's job


def test_a_lightning_without_the_decisions_it_replaces_is_named(tmp_path, monkeypatch):
    """Stands for a Lightning version where the epoch loop no longer has ``_accumulated_batches_reached``."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    monkeypatch.delattr(_TrainingEpochLoop, "_accumulated_batches_reached")
    with pytest.raises(RuntimeError, match=rf"GradientAccumulation: Lightning {pl.__version__} lacks "
                                           r"fit_loop.epoch_loop._accumulated_batches_reached"):
        trainer(tmp_path, callbacks=[GradientAccumulation(2)]).fit(Regression(), regression_data())


def test_total_steps_in_target_mode_waits_for_setup(tmp_path):
    run = trainer(tmp_path, callbacks=[GradientAccumulation(global_batch_size=8)])
    with pytest.raises(RuntimeError, match=r"GradientAccumulation.total_steps: the count for global_batch_size=8 is "
                                           r"derived in the callback's setup; call total_steps from configure_opt"):
        GradientAccumulation.total_steps(run)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({}, ValueError, r"GradientAccumulation\(schedule=None, global_batch_size=None\): give exactly one of them"),
    ({"schedule": 2, "global_batch_size": 8}, ValueError,
     r"GradientAccumulation\(schedule=2, global_batch_size=8\): give exactly one of them"),
    ({"global_batch_size": 8.0}, TypeError, r"GradientAccumulation\(global_batch_size=8\.0\): global_batch_size must be an integer"),
    ({"global_batch_size": 0}, ValueError, r"GradientAccumulation\(global_batch_size=0\): global_batch_size must be an integer >= 1"),
    ({"schedule": {0: 0}}, ValueError, r"GradientAccumulation\(schedule=\{0: 0\}\): step 0 has count 0"),
    ({"schedule": [1, 2]}, TypeError, r"GradientAccumulation\(schedule=\[1, 2\]\): schedule must be an int or a dict"),
])
def test_bad_settings_fail_when_the_callback_is_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientAccumulation(**kwargs)


@pytest.mark.parametrize(("init_args", "expected"), [
    ("{schedule: {0: 1, 100: 4}}", ({0: 1, 100: 4}, None)),
    ("{global_batch_size: 64}", (None, 64)),
])
def test_the_yaml_form_parses_with_integer_steps(init_args, expected, tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    monkeypatch.setattr(sys, "argv", ["test"])
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  logger: false\n  callbacks:\n"
        "    - class_path: lightning_peft.callbacks.gradient_accumulation.GradientAccumulation\n"
        f"      init_args: {init_args}\n"
    )
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=["--config", str(config)],
                       save_config_callback=None)
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, GradientAccumulation)]
    schedule = None if callback.schedule is None else callback.schedule.schedule
    assert (schedule, callback.global_batch_size) == expected
    assert schedule is None or all(type(k) is int for k in schedule)


# ------------------------------------------------------------------ data-parallel size (2 processes, gloo)

@pytest.fixture(scope="module")
def model_parallel_runs(two_ranks) -> Path:
    return two_ranks.path("accumulation")  # accumulation_script.py on 2 ranks (tests/_two_ranks.py)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", ["pipeline", "tensor"])
def test_a_global_batch_counts_data_parallel_replicas_not_processes(model_parallel_runs: Path, case: str) -> None:
    """global_batch_size=32, batches of 8, 2 processes that read the same batch (2 pipeline stages; one
    tensor-parallel group of 2): 4 micro-batches per step, as one process with accumulate_grad_batches=4 (the count
    from trainer.world_size was 2: 4 steps of 16 samples while the log said 32)."""
    for rank in (0, 1):
        result = torch.load(model_parallel_runs / f"{case}-rank{rank}.pt", weights_only=False)
        assert result["counts"] == [4, 4] and result["steps"] == 2
        assert result["weights"]
        for name, value in result["expected"].items():
            assert_close(result["weights"][name], value, rtol=0, atol=1e-5, msg=f"{case} rank {rank} {name}")
