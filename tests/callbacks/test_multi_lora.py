"""The MultiLoRA callback under a real Trainer: per-sample routing equals the pure functions in a plain loop, unused
adapters stay untouched, resume equals a straight run, exports hold every adapter."""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import peft
import pytest
import torch
from torch.testing import assert_close
from torch.utils.data import DataLoader

from lightning_peft.callbacks import LoRA, MergeOnSave, MultiLoRA
from lightning_peft.peft import active_adapter, add_adapter, inject_lora, lora_layers, route_adapters, set_adapter
from tests._models import Classifier, trainer

ADAPTERS = {
    "news": {"rank": 2, "alpha": 4, "target_modules": ["query", "value"]},
    "sport": {"rank": 4, "alpha": 4, "target_modules": ["query", "key"], "init": "gaussian"},
}
ROUTES = [["news", "sport", None, "news"], [1, 0, 0, -1], ["sport", "sport", "news", None]]


class Routed(Classifier):
    """The shared tiny BERT classifier, seeded, with weight decay and a validation loss; batches are dicts."""

    def __init__(self, config) -> None:
        torch.manual_seed(0)
        super().__init__(config, weight_decay=0.1)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))


def batches(routes=ROUTES) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for route in routes:
        out.append({"input_ids": torch.randint(0, 64, (4, 8), generator=generator),
                    "labels": torch.randint(0, 3, (4,), generator=generator), "adapter": route})
    return out


def loader(routes=ROUTES) -> DataLoader:
    return DataLoader(batches(routes), batch_size=None)


def _names(route):
    return [None if r in (None, -1) else (list(ADAPTERS)[r] if isinstance(r, int) else r) for r in route]


def test_routed_training_equals_the_pure_functions_in_a_plain_loop(tiny_bert_config, tmp_path):
    module = Routed(tiny_bert_config)
    model = copy.deepcopy(module.model)
    callback = MultiLoRA(adapters=ADAPTERS, modules_to_save=["classifier"])
    torch.manual_seed(7)
    trainer(tmp_path, max_steps=3, callbacks=[callback]).fit(module, loader())

    torch.manual_seed(7)
    inject_lora(model, adapter_name="news", modules_to_save=["classifier"], **ADAPTERS["news"])
    add_adapter(model, "sport", modules_to_save=["classifier"], **ADAPTERS["sport"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)
    model.train()
    for batch in batches():
        with route_adapters(model, _names(batch["adapter"])):
            model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = dict(module.model.named_parameters())
    for name, param in model.named_parameters():
        assert_close(trained[name], param, rtol=1e-6, atol=1e-6, msg=name)
    assert active_adapter(module.model) == "news"


def test_an_adapter_no_batch_uses_stays_bit_for_bit_unchanged(tiny_bert_config, tmp_path):
    module = Routed(tiny_bert_config)
    callback = MultiLoRA(adapters=ADAPTERS, active="sport", modules_to_save=[])
    initial = {}

    class Record(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            initial.update({n: p.clone() for n, p in pl_module.named_parameters() if ".news." in n})

    routes = [["sport", None, "sport", "sport"], [None, None, "sport", None]]
    trainer(tmp_path, max_steps=2, callbacks=[callback, Record()]).fit(module, loader(routes))
    after = dict(module.named_parameters())
    assert initial and all(torch.equal(after[n], v) for n, v in initial.items())
    sport = [p for n, p in after.items() if ".sport." in n and "lora_B" in n]
    assert all(torch.count_nonzero(p) for p in sport)  # it trained (B starts at zero)


def test_batches_without_the_key_use_the_active_adapter_and_counts_are_logged(tiny_bert_config, tmp_path):
    module = Routed(tiny_bert_config)
    callback = MultiLoRA(adapters=ADAPTERS, active="sport")
    unrouted = [{k: v for k, v in b.items() if k != "adapter"} for b in batches()]
    fit = trainer(tmp_path, max_steps=3, limit_val_batches=2, callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(module, loader(), DataLoader(unrouted, batch_size=None))
    assert not [w for w in caught if "MultiLoRA" in str(w.message)]  # unrouted validation batches: no warning
    metrics = fit.callback_metrics
    assert metrics["train_adapter_samples/news"] == 5 and metrics["train_adapter_samples/sport"] == 4
    assert "val_adapter_samples/news" not in metrics  # the validation batches had no routing key
    model = module.model.eval()
    with torch.no_grad():
        expected = model(input_ids=unrouted[0]["input_ids"]).logits
        with route_adapters(model, ["sport"] * 4):  # the routed path (bmm) rounds unlike the active one (addmm)
            assert_close(model(input_ids=unrouted[0]["input_ids"]).logits, expected)


def test_a_routing_key_no_training_batch_has_is_warned_about_once(tiny_bert_config, tmp_path):
    module = Routed(tiny_bert_config)
    callback = MultiLoRA(adapters=ADAPTERS, routing_key="task")  # the batches say "adapter"
    with pytest.warns(UserWarning, match=r"MultiLoRA: a training batch has no 'task' entry \(its entries: "
                                         r"\['input_ids', 'labels', 'adapter'\]\), so it trains the active adapter "
                                         r"'news' alone.* or set routing_key= to the entry that does") as caught:
        trainer(tmp_path, max_steps=3, callbacks=[callback]).fit(module, loader())
    assert len([w for w in caught if "MultiLoRA: a training batch" in str(w.message)]) == 1
    assert not any(torch.count_nonzero(p) for n, p in module.named_parameters() if "lora_B.sport" in n)


def test_merge_on_save_exports_every_adapter_and_the_chosen_merged_model(tiny_bert_config, tmp_path):
    module = Routed(tiny_bert_config)
    callbacks = [MultiLoRA(adapters=ADAPTERS), MergeOnSave(dirpath=str(tmp_path / "out"), adapter_name="sport")]
    trainer(tmp_path, max_steps=3, callbacks=callbacks).fit(module, loader())
    assert sorted(p.name for p in (tmp_path / "out" / "adapter").iterdir()) == [
        "lightning_peft_export.json", "news", "sport"]  # the manifest that ties adapter/ to merged/

    from transformers import BertForSequenceClassification

    ids = batches()[0]["input_ids"]
    model = module.model.eval()
    set_adapter(model, "sport")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    merged = BertForSequenceClassification.from_pretrained(tmp_path / "out" / "merged").eval()
    assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    base = BertForSequenceClassification(tiny_bert_config).eval()
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "out" / "adapter" / "sport").eval()
    assert_close(theirs(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_bad_routing_entries_and_settings_are_refused(tiny_bert_config, tmp_path):
    with pytest.raises(ValueError, match=r"MultiLoRA: batch\['adapter'\] holds 'golf', which names no adapter; give one "
                                         r"of \['news', 'sport'\], an id in 0..1 \(their order\), or -1 / None"):
        trainer(tmp_path, max_steps=1, callbacks=[MultiLoRA(adapters=ADAPTERS)]).fit(
            Routed(tiny_bert_config), loader([["news", "golf", None, None]])
        )
    with pytest.raises(ValueError, match=r"MultiLoRA: batch\['adapter'\] holds 2, which names no adapter"):
        MultiLoRA(adapters=ADAPTERS).names_of({"adapter": torch.tensor([0, 2])})
    with pytest.raises(ValueError, match=r"MultiLoRA\(adapters=\{\}\): give a non-empty dict"):
        MultiLoRA(adapters={})
    with pytest.raises(ValueError, match=r"MultiLoRA\(adapters\['a'\]\): modules_to_save is shared by every adapter; "
                                         r"set MultiLoRA\(modules_to_save=...\)"):
        MultiLoRA(adapters={"a": {"rank": 2, "modules_to_save": ["classifier"]}})
    with pytest.raises(TypeError, match=r"MultiLoRA\(adapters\['a'\]\)\(r=2\): lightning-peft calls this argument 'rank'"):
        MultiLoRA(adapters={"a": {"r": 2}})
    with pytest.raises(ValueError, match=r"MultiLoRA\(active='golf'\): not one of the adapters \['news', 'sport'\]"):
        MultiLoRA(adapters=ADAPTERS, active="golf")
    with pytest.raises(ValueError, match=r"MergeOnSave\(adapter_name='golf'\): the model has no named adapter of that "
                                         r"name; its named adapters: \['news', 'sport'\]"):
        trainer(tmp_path, max_steps=1, callbacks=[MultiLoRA(adapters=ADAPTERS),
                                                  MergeOnSave(dirpath=str(tmp_path), adapter_name="golf")]).fit(
            Routed(tiny_bert_config), loader()
        )
    assert all(not layer.routing.names for layer in lora_layers(Routed(tiny_bert_config).model).values())


@pytest.mark.parametrize("lora_first", [True, False])
def test_lora_and_multilora_on_one_model_are_refused_naming_both(tiny_bert_config, tmp_path, lora_first):
    pair = [LoRA(rank=2, target_modules=["query"]), MultiLoRA(adapters=ADAPTERS)]
    module = Routed(tiny_bert_config)
    first, second = ("LoRA", "MultiLoRA") if lora_first else ("MultiLoRA", "LoRA")
    with pytest.raises(ValueError, match=(
        rf"{first} and {second} in one Trainer both adapt BertForSequenceClassification \('model'\), and a model "
        r"carries one set of lora adapters: the second callback would find the first's and refuse\. Keep one: "
        r"MultiLoRA alone, with LoRA's settings as one of its adapters .*or LoRA alone\."
    )):
        trainer(tmp_path, max_steps=1, callbacks=pair if lora_first else pair[::-1]).fit(module, loader())
    assert not lora_layers(module.model)  # refused before either injected


def test_a_routed_batch_on_a_merged_model_is_refused_and_routing_ends_after_each_batch(tiny_bert_config, tmp_path):
    from lightning_peft.peft import attached, merge_lora

    module = Routed(tiny_bert_config).eval()
    callback = MultiLoRA(adapters=ADAPTERS)
    trainer(tmp_path, callbacks=[callback]).validate(module, loader())
    spec = attached(module.model)["lora"]
    assert spec.routing.names is None  # routing ended with the batch
    merge_lora(module.model, "news")  # routing goes through route_adapters, which refuses a merged model
    with pytest.raises(RuntimeError, match=r"route_adapters: adapter 'news' is merged into the base weights"):
        trainer(tmp_path, callbacks=[callback]).validate(module, loader())
    assert spec.routing.names is None
