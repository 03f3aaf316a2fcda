"""MergeOnSave: a merged model that transformers loads without PEFT, a PEFT adapter, training untouched."""

from __future__ import annotations

import contextlib
import copy
import json
import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch import nn
from torch.testing import assert_close

from lightning_peft.callbacks import LoRA, MergeOnSave
from lightning_peft.peft import inject_lora, lora_layers
from tests._models import LORA_ARGS, Classifier, gpt2_model, loader, trainer


def fit_with_export(config, tmp_path, **merge_kwargs) -> tuple[Classifier, dict, MergeOnSave, pl.Trainer]:
    module = Classifier(config)
    base_state = {k: v.clone() for k, v in module.model.state_dict().items()}
    export = MergeOnSave(dirpath=str(tmp_path / "out"), **merge_kwargs)
    run = trainer(tmp_path, max_steps=4, callbacks=[LoRA(**LORA_ARGS), export])
    run.fit(module, loader())
    return module, base_state, export, run


def test_merged_model_loads_with_plain_transformers_and_adapter_with_peft(tiny_bert_config, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, BertForSequenceClassification

    module, base_state, export, _ = fit_with_export(tiny_bert_config, tmp_path)
    assert export.last_export == {"merged": tmp_path / "out" / "merged", "adapter": tmp_path / "out" / "adapter"}
    ids = torch.randint(0, 64, (3, 8))
    module.model.eval()
    expected = module.model(input_ids=ids).logits
    assert any(torch.count_nonzero(layer.lora_B["default"].weight) for layer in lora_layers(module.model).values())

    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "merged").eval()
    assert type(merged) is BertForSequenceClassification and not lora_layers(merged)
    assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)

    base = BertForSequenceClassification(tiny_bert_config)
    base.load_state_dict(base_state)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
    assert_close(peft_model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)
    assert not list((tmp_path / "out").glob(".*"))  # no temporary directories left


def test_export_does_not_change_the_training_weights(tiny_bert_config, tmp_path):
    module, _, export, run = fit_with_export(tiny_bert_config, tmp_path)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    export.export(run, module, tmp_path / "again")
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert not any(layer.merged for layer in lora_layers(module.model).values())


def test_every_checkpoint_exports_beside_each_checkpoint(tiny_bert_config, tmp_path):
    module = Classifier(tiny_bert_config)
    export = MergeOnSave(dirpath=str(tmp_path / "out"), every_checkpoint=True, save_adapter=False)
    callbacks = [LoRA(**LORA_ARGS), export, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)]
    trainer(tmp_path, max_epochs=2, callbacks=callbacks, enable_checkpointing=True).fit(module, loader())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["merged", "step=4", "step=8"]
    assert (tmp_path / "out" / "step=4" / "merged" / "config.json").is_file()
    assert not (tmp_path / "out" / "step=4" / "adapter").exists()


def test_a_failed_export_keeps_the_previous_one(tiny_bert_config, tmp_path):
    module, _, export, run = fit_with_export(tiny_bert_config, tmp_path)
    merged_dir = tmp_path / "out" / "merged"
    files = {p.name: p.read_bytes() for p in merged_dir.iterdir()}
    with torch.no_grad():
        next(iter(lora_layers(module.model).values())).lora_B["default"].weight.fill_(float("nan"))
    with pytest.raises(RuntimeError, match=r"merged_state_dict: layer 'bert.encoder.layer.0.attention.self.query'"):
        export.export(run, module, tmp_path / "out")
    assert {p.name: p.read_bytes() for p in merged_dir.iterdir()} == files


class PlainModule(pl.LightningModule):
    """Not a Hugging Face model: the merged export is a safetensors state dict with the original keys."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


def test_plain_torch_model_exports_a_state_dict_with_the_original_keys(tmp_path):
    module = PlainModule()
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    export = MergeOnSave(dirpath=str(tmp_path / "out"), model_attribute="net")
    run = trainer(tmp_path, max_steps=3, callbacks=[LoRA(rank=2, target_modules=["0"], model_attribute="net"), export])
    run.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    state = load_file(tmp_path / "out" / "merged" / "model.safetensors")
    fresh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fresh.load_state_dict(state)
    x = torch.randn(5, 4)
    assert_close(fresh(x), module.net(x))
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()


class TiedModule(PlainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6))
        self.net[1].weight = self.net[0].weight  # tied input and output embeddings

    def training_step(self, batch, batch_idx):
        ids, y = batch
        return nn.functional.cross_entropy(self.net(ids).mean(1), y)


def test_plain_model_with_tied_weights_exports(tmp_path):
    module = TiedModule()
    data = torch.utils.data.TensorDataset(torch.randint(0, 6, (8, 3)), torch.randint(0, 6, (8,)))
    export = MergeOnSave(dirpath=str(tmp_path / "out"), model_attribute="net")
    run = trainer(tmp_path, max_steps=2, callbacks=[LoRA(rank=2, target_modules=["0"], model_attribute="net"), export])
    run.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    state = load_file(tmp_path / "out" / "merged" / "model.safetensors")
    layer = module.net[0]
    assert_close(state["0.weight"], layer.base_layer.weight + layer.delta_weight())
    assert torch.equal(state["1.weight"], module.net[1].weight)  # the head kept the unadapted tied weight


def test_without_an_adapter_it_names_the_peft_callbacks(tiny_bert_config, tmp_path):
    with pytest.raises(RuntimeError, match=r"MergeOnSave: BertForSequenceClassification has no adapter when fit "
                                           r"starts\. Add a PEFT callback \(LoRA, MultiLoRA, BottleneckAdapters, "
                                           r"PromptTuning, PrefixTuning\)"):
        trainer(tmp_path, max_steps=1, callbacks=[MergeOnSave(dirpath=str(tmp_path))]).fit(
            Classifier(tiny_bert_config), loader()
        )


class BuiltInConfigureModel(PlainModule):
    """The model only exists after configure_model, and is adapted there with the pure function."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            inject_lora(self.net, rank=2, target_modules=["0"])


def test_a_model_adapted_in_configure_model_is_exported(tmp_path):
    module = BuiltInConfigureModel()
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    export = MergeOnSave(dirpath=str(tmp_path / "out"), model_attribute="net")
    trainer(tmp_path, max_steps=2, callbacks=[export]).fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert set(load_file(tmp_path / "out" / "merged" / "model.safetensors")) == {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"dirpath": 5}, TypeError, (r"MergeOnSave\(dirpath=5\): dirpath must be a path \(str or os\.PathLike\), "
                                 r"e\.g\. 'artifacts/run'\.")),
    ({"dirpath": ""}, ValueError, r"MergeOnSave\(dirpath=''\): dirpath must be a non-empty path, e\.g\. 'artifacts/run'"),
    ({"every_checkpoint": "yes"}, TypeError, r"MergeOnSave\(every_checkpoint='yes'\): every_checkpoint must be True"),
    ({"save_adapter": 1}, TypeError, r"MergeOnSave\(save_adapter=1\): save_adapter must be True or False\."),
    ({"save_merged": None}, TypeError, r"MergeOnSave\(save_merged=None\): save_merged must be True or False\."),
    ({"adapter_name": 0}, TypeError, r"MergeOnSave\(adapter_name=0\): adapter_name must be a name \(str\) or None"),
    ({"model_attribute": ["model"]}, TypeError, (r"MergeOnSave\(model_attribute=\['model'\]\): model_attribute must "
                                                 r"be a name \(str\) or None, e\.g\. 'model'\.")),
])
def test_bad_arguments_are_refused_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        MergeOnSave(**kwargs)


def test_a_pathlib_dirpath_is_taken(tmp_path):
    assert MergeOnSave(dirpath=tmp_path / "run").dirpath == tmp_path / "run"


def test_techniques_that_cannot_merge_export_the_adapter_alone(tiny_bert_config, tmp_path):
    from lightning_peft.callbacks import BottleneckAdapters
    from lightning_peft.peft import load_adapter

    adapters = BottleneckAdapters(placement="pfeiffer", reduction_factor=4)
    with pytest.raises(ValueError, match=r"MergeOnSave: the bottleneck adapter cannot be merged into the base weights, "
                                         r"so there is no merged model to write\. Export the adapter only: "
                                         r"MergeOnSave\(save_merged=False\)"):
        trainer(tmp_path, max_steps=1, callbacks=[adapters, MergeOnSave(dirpath=str(tmp_path / "a"))]).fit(
            Classifier(tiny_bert_config), loader()
        )
    assert not (tmp_path / "a" / "merged").exists()  # refused at fit start, before any training
    module = Classifier(tiny_bert_config)
    export = MergeOnSave(dirpath=str(tmp_path / "b"), save_merged=False)
    trainer(tmp_path, max_steps=2, callbacks=[BottleneckAdapters(placement="pfeiffer", reduction_factor=4), export]).fit(
        module, loader()
    )
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["adapter"]
    from transformers import BertForSequenceClassification

    fresh = load_adapter(BertForSequenceClassification(tiny_bert_config), tmp_path / "b" / "adapter").eval()
    ids = next(iter(loader()))[0]
    module.model.eval()
    with torch.no_grad():
        fresh.load_state_dict({k: v for k, v in module.model.state_dict().items() if "adapter" not in k}, strict=False)
        assert_close(fresh(input_ids=ids).logits, module.model(input_ids=ids).logits)
    with pytest.raises(ValueError, match=r"MergeOnSave\(save_adapter=False, save_merged=False\): nothing to export"):
        MergeOnSave(save_adapter=False, save_merged=False)


def test_lora_after_bottleneck_leaves_the_head_it_already_trains_alone(tiny_bert_config):
    from transformers import BertForSequenceClassification

    from lightning_peft.peft import ModulesToSave, inject_bottleneck_adapters

    model = BertForSequenceClassification(tiny_bert_config)
    inject_bottleneck_adapters(model, placement="pfeiffer", reduction_factor=4)  # saves the task head
    inject_lora(model, rank=2, target_modules=["query"])  # modules_to_save=None: the head is taken already
    assert isinstance(model.classifier, ModulesToSave) and not isinstance(model.classifier.trained_module, ModulesToSave)
    other = BertForSequenceClassification(tiny_bert_config)
    inject_bottleneck_adapters(other, placement="pfeiffer", reduction_factor=4)
    with pytest.raises(ValueError, match=r"LoRA\(modules_to_save=\['classifier'\]\): 'classifier' is already trained in "
                                         r"full by another technique"):
        inject_lora(other, rank=2, target_modules=["query"], modules_to_save=["classifier"])


EXPORT_SCRIPT = """
import lightning.pytorch as pl, torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification
from lightning_peft.callbacks import LoRA, MergeOnSave

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1,
            num_attention_heads=2, intermediate_size=16, num_labels=2))
    def training_step(self, batch, _):
        return self.model(input_ids=batch[0], labels=batch[1]).loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = DataLoader(TensorDataset(torch.randint(0, 32, (4, 6)), torch.randint(0, 2, (4,))), batch_size=2)
pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
           callbacks=[LoRA(rank=2, target_modules=["query"]), MergeOnSave(dirpath=OUT)]).fit(Module(), data)
"""


def test_a_single_process_export_prints_no_deepspeed_accelerator_warning(tmp_path):
    """save_pretrained imports accelerate, which imports DeepSpeed when installed; its "Setting accelerator to CPU"
    warning does not belong in a run that never used DeepSpeed (a fresh process: the import happens once)."""
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    script = f"OUT = {str(tmp_path / 'export')!r}\n" + EXPORT_SCRIPT
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "export" / "merged" / "config.json").is_file()
    assert "Setting accelerator to CPU" not in result.stdout + result.stderr


class CausalLM(pl.LightningModule):
    """A tiny GPT-2 LM head model in float64 (tied input and output embeddings, as GPT-2 ships)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = gpt2_model(vocab_size=50).double()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


@contextlib.contextmanager
def transformers_warnings():
    """The messages transformers logs while the block runs (its loggers do not propagate to the root)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)


@pytest.mark.parametrize(("target", "untied"), [("lm_head", True), ("wte", True), ("c_attn", False)])
def test_a_tied_model_with_an_adapted_embedding_is_exported_untied(target, untied, tmp_path):
    """An adapter on the LM head or the token embedding of a tied GPT-2 makes the merged two differ: the export holds
    both and its config says tie_word_embeddings=False (a loader that follows the config would re-tie them and lose
    the adapted one). An adapter elsewhere leaves the config, and the one shared matrix, as they were."""
    from transformers import GPT2LMHeadModel

    module = CausalLM()
    ids = torch.randint(0, 50, (4, 8))
    run = trainer(tmp_path, max_steps=2, callbacks=[LoRA(rank=2, target_modules=[target]),
                                                    MergeOnSave(dirpath=str(tmp_path / "out"), save_adapter=False)])
    run.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2))
    merged = tmp_path / "out" / "merged"
    assert json.loads((merged / "config.json").read_text())["tie_word_embeddings"] is (not untied)
    assert module.model.config.tie_word_embeddings is True  # the live config, shared by its submodules, is unchanged
    assert module.model.transformer.config is module.model.config
    saved = load_file(merged / "model.safetensors")
    assert ("lm_head.weight" in saved) is untied and "transformer.wte.weight" in saved
    module.model.eval()
    with torch.no_grad(), transformers_warnings() as warned:
        expected = module.model(input_ids=ids).logits
        loaded = GPT2LMHeadModel.from_pretrained(merged, dtype=torch.float64).eval()
        assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-12, atol=1e-12)
    assert not [message for message in warned if "tie" in message], warned
    lm_head, wte = loaded.lm_head.weight, loaded.transformer.wte.weight
    assert (lm_head.data_ptr() != wte.data_ptr()) is untied and torch.equal(lm_head, wte) is (not untied)


def test_the_adapter_export_of_a_causal_lm_loads_with_auto_peft_model_and_its_base(tmp_path, monkeypatch):
    """adapter/ says task_type CAUSAL_LM, so PEFT's AutoPeftModelForCausalLM loads it with the base its
    base_model_name_or_path names (a local folder here, found from the folder above) and computes what we did."""
    import peft

    module = CausalLM()
    module.model.save_pretrained(tmp_path / "base")
    module.model.config._name_or_path = str(tmp_path / "base")  # as from_pretrained leaves it
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(0))
    run = trainer(tmp_path, max_steps=2, callbacks=[LoRA(rank=2, target_modules=["c_attn"]),
                                                    MergeOnSave(dirpath=str(tmp_path / "out"), save_merged=False)])
    run.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2))
    monkeypatch.chdir(tmp_path)
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained("out/adapter", dtype=torch.float64).eval()
    module.model.eval()
    with torch.no_grad():
        assert_close(loaded(input_ids=ids).logits, module.model(input_ids=ids).logits, rtol=0, atol=1e-10)
        with loaded.disable_adapter():  # (the adapter trained: it changes the outputs)
            assert (loaded(input_ids=ids).logits - module.model(input_ids=ids).logits).abs().max() > 1e-6


def _plain_fit(tmp_path, export: MergeOnSave, max_steps: int = 2) -> pl.Trainer:
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    run = trainer(tmp_path, max_steps=max_steps,
                  callbacks=[LoRA(rank=2, target_modules=["0"], model_attribute="net"), export])
    run.fit(PlainModule(), torch.utils.data.DataLoader(data, batch_size=4))
    return run


def test_merged_and_adapter_name_one_export_and_stale_temporaries_are_removed_by_the_next(tmp_path):
    from lightning_peft._atomic import HOST
    from lightning_peft._manifest import MANIFEST

    out = tmp_path / "out"
    run = _plain_fit(tmp_path, MergeOnSave(dirpath=str(out), model_attribute="net"))
    first = [json.loads((out / part / MANIFEST).read_text()) for part in ("merged", "adapter")]
    assert first[0]["export"] == first[1]["export"] and first[0]["global_step"] == run.global_step == 2
    assert set(first[0]["files"]) == {"model.safetensors", "lightning_peft_training.json"}
    import shutil  # what killed writers left: a temporary of ours, and a moved-aside folder of an earlier version

    shutil.copytree(out / "adapter", out / f".adapter.new-{HOST}-999999999-x")
    shutil.copytree(out / "merged", out / ".merged.old-999999999")
    _plain_fit(tmp_path, MergeOnSave(dirpath=str(out), model_attribute="net"), max_steps=3)
    again = [json.loads((out / part / MANIFEST).read_text()) for part in ("merged", "adapter")]
    assert again[0]["export"] == again[1]["export"] != first[0]["export"] and again[0]["global_step"] == 3
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "merged"]


def test_a_symlinked_merged_folder_is_refused_before_training(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "merged").symlink_to(tmp_path / "elsewhere")
    export = MergeOnSave(dirpath=str(tmp_path / "out"), model_attribute="net")
    with pytest.raises(ValueError, match=r"MergeOnSave\(dirpath='.*out'\): .*out/merged is a symbolic link \(to "
                                         r".*elsewhere\); an atomic write replaces the link, not what it points to"):
        _plain_fit(tmp_path, export)
    assert not list((tmp_path / "elsewhere").iterdir())


def test_too_little_free_space_is_refused_before_training_naming_folder_needed_and_free(small_disk, tmp_path):
    import re
    import shutil

    disk = small_disk(4096)
    module = PlainModule()
    module.net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    data = torch.utils.data.TensorDataset(torch.randn(8, 64), torch.randint(0, 2, (8,)))
    run = trainer(tmp_path, max_steps=2, callbacks=[LoRA(rank=2, target_modules=["0"], model_attribute="net"),
                                                   MergeOnSave(dirpath=str(disk), model_attribute="net")])
    with pytest.raises(RuntimeError, match=r"MergeOnSave\(dirpath='.*disk'\): the export needs at least 17\.8 KiB "
                                           r"\(16\.8 KiB merged \+ 1\.0 KiB adapter\) but the filesystem of '.*disk' "
                                           r"has 4\.0 KiB free \(\d+ > \d+ bytes\)") as caught:
        run.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    needed, free = map(int, re.search(r"\((\d+) > (\d+) bytes\)", str(caught.value)).groups())
    base, adapter = (64 * 64 + 64 + 2 * 64 + 2) * 4, (2 * 64 + 64 * 2) * 4  # float32 weights and LoRA factors
    assert free == shutil.disk_usage(disk).free and needed == base + adapter
    assert run.global_step == 0


def test_the_size_estimate_is_a_tight_lower_bound_of_what_is_written(tmp_path):
    from lightning_peft.callbacks._export_checks import export_bytes

    out = tmp_path / "out"
    export = MergeOnSave(dirpath=str(out), model_attribute="net")
    run = _plain_fit(tmp_path, export)
    needed = export_bytes(run.lightning_module.net, merged=True, adapter=True)
    for part, file in (("merged", "model.safetensors"), ("adapter", "adapter_model.safetensors")):
        written = (out / part / file).stat().st_size
        assert 0 < needed[part] <= written < needed[part] + 1024, part  # the rest is the safetensors header


def test_model_attribute_empty_next_to_a_default_lora_names_the_argument_and_the_fix(tiny_bert_config, tmp_path):
    export = MergeOnSave(dirpath=str(tmp_path / "out"), model_attribute="")
    with pytest.raises(RuntimeError, match=r"MergeOnSave\(model_attribute=''\) exports the whole LightningModule "
                                           r"\(Classifier\), which has no adapter; the PEFT callbacks adapted 'model'\. "
                                           r"Give MergeOnSave the PEFT callback's model_attribute \(here "
                                           r"MergeOnSave\(model_attribute='model'\), or None where the callback has None\)"):
        trainer(tmp_path, max_steps=1, callbacks=[LoRA(**LORA_ARGS), export]).fit(Classifier(tiny_bert_config), loader())


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora"])
def test_a_pissa_adapter_exports_merged_and_converted_onto_the_original_base(tmp_path, init):
    """The LoRA callback with init='pissa' rewrites the base; merged/ is the trained model and adapter/ is PEFT's rank-2r
    conversion, which PEFT and load_adapter load onto the original base and compute the trained model with."""
    import peft

    from lightning_peft.peft import load_adapter

    module = PlainModule()
    original = {k: v.clone() for k, v in module.net.state_dict().items()}
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    export = MergeOnSave(dirpath=str(tmp_path / "out"), model_attribute="net")
    lora = LoRA(rank=2, alpha=4, target_modules=["0"], init=init, model_attribute="net")
    trainer(tmp_path, max_steps=3, callbacks=[lora, export]).fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    x = torch.randn(5, 4)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fresh.load_state_dict(load_file(tmp_path / "out" / "merged" / "model.safetensors"))
    assert_close(fresh(x), module.net(x))
    fresh.load_state_dict(original)
    assert json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())["r"] == 4
    ours = load_adapter(copy.deepcopy(fresh), tmp_path / "out" / "adapter")
    assert_close(ours(x), module.net(x))
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "out" / "adapter")
    assert_close(loaded(x), module.net(x))


class Counting(pl.LightningModule):
    """``net`` trained on batches of ``shape`` to a squared output; counts its training steps."""

    def __init__(self, net: nn.Module, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.net, self.shape, self.batches = net, shape, 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    def data(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, *self.shape)), batch_size=4)


@pytest.mark.parametrize(("net", "shape", "lora", "problem"), [
    (lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)), (4, 5, 5), {},
     r"lora: '0' is a Conv2d with groups=2, whose weight cannot hold the update \(it reads every input channel\)"),
    (lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)), (4, 5, 5), {"use_dora": True},
     r"lora: '0' is a Conv2d with groups=2"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False)), (4,), {"lora_bias": True},
     r"lora: '1' has lora_bias=True, but its Linear has no bias to merge B's bias into"),
], ids=["grouped conv", "grouped conv DoRA", "lora_bias without a base bias"])
def test_a_merge_the_layers_refuse_is_refused_before_the_first_batch(tmp_path, net, shape, lora, problem):
    """merged/ used to fail at the first export, after the whole run; the adapter alone still exports."""
    module = Counting(net(), shape)
    callbacks = [LoRA(rank=2, target_modules=["0", "1"][:len(module.net)], model_attribute="net", **lora),
                 MergeOnSave(dirpath=str(tmp_path / "out"), model_attribute="net")]
    with pytest.raises(ValueError, match=rf"MergeOnSave\(save_merged=True\): the merged export would be refused at its "
                                         rf"first write, as PEFT refuses these merges: {problem}.*\. Export the adapter "
                                         r"only \(MergeOnSave\(save_merged=False\)\), or leave those layers out"):
        trainer(tmp_path, max_steps=2, callbacks=callbacks).fit(module, module.data())
    assert module.batches == 0
    module = Counting(net(), shape)
    export = MergeOnSave(dirpath=str(tmp_path / "out"), model_attribute="net", save_merged=False)
    callbacks = [LoRA(rank=2, target_modules=["0", "1"][:len(module.net)], model_attribute="net", **lora), export]
    trainer(tmp_path, max_steps=2, callbacks=callbacks).fit(module, module.data())
    assert sorted(export.last_export) == ["adapter"]


def test_a_loftq_adapter_is_refused_an_adapter_export_before_the_first_batch_and_exports_merged(tmp_path):
    """LoftQ's trained model is no plain LoRA on the original base: only merged/ represents it."""
    def fit(module, **export):
        lora = LoRA(rank=2, target_modules=["0"], model_attribute="net", init="loftq", quantize="nf4")
        export = MergeOnSave(dirpath=str(tmp_path / "out"), model_attribute="net", **export)
        trainer(tmp_path, max_steps=2, callbacks=[lora, export]).fit(module, module.data())
        return module

    module = Counting(nn.Sequential(nn.Linear(16, 16)).double(), (16,))
    with pytest.raises(ValueError, match=r"MergeOnSave\(save_adapter=True\): save_adapter: adapter 'default' started "
                                         r"with init='loftq', .* To export the merged model alone: "
                                         r"MergeOnSave\(save_adapter=False\)\."):
        fit(module)
    assert module.batches == 0
    module = fit(Counting(nn.Sequential(nn.Linear(16, 16)).double(), (16,)), save_adapter=False)
    fresh = nn.Sequential(nn.Linear(16, 16)).double()
    fresh.load_state_dict(load_file(tmp_path / "out" / "merged" / "model.safetensors"))
    x = torch.randn(5, 16, dtype=torch.float64)
    assert_close(fresh(x), module.net(x), rtol=1e-12, atol=1e-12)
