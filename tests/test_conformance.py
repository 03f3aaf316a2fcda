"""Every registered PEFT technique keeps the same promises, through its public callback and functions only.

One row per technique (LoRA, LoRA with DoRA, named multi-LoRA, bottleneck adapters, IA³, LoHa, LoKr, VeRA, AdaLoRA
(its allocation runs during the fits, so a resume must restore the allocator's scores and step), prompt tuning,
P-tuning, prefix tuning with and without its projection MLP); for each:

- resume: a fit resumed from an epoch-boundary checkpoint (adapter-only or full) ends with the straight run's
  weights, bit for bit; resuming with other settings is refused, naming both values;
- adapter-only checkpoints hold the trained tensors alone, are smaller than full ones, and come back through
  ``lightning_peft.callbacks.load_from_checkpoint`` with the trained model's outputs, exactly (full ones too);
- save/load: ``save_adapter`` then ``load_adapter`` into a fresh base gives the same outputs, exactly (a tiny
  GPT-2); where a Hugging Face PEFT format exists, ``peft.PeftModel`` loads ours with our outputs and we load
  PEFT's with its outputs (float64, so only rounding of the order of 1e-15 is left);
- dtype casts: ``model.double()`` reaches every adapter tensor; a cast to bfloat16/float16 keeps LoRA's and the
  bottleneck's own weights float32 and unrounded (prompt and prefix tensors follow the cast).

The Trainer runs share one module-scoped set of fits per technique: a straight 2-epoch run with adapter-only
checkpoints, a 1-epoch run with full checkpoints, and a resume from each.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_peft.callbacks import (
    BOFT,
    IA3,
    AdaLoRA,
    OFT,
    BottleneckAdapters,
    LoHa,
    LoKr,
    LoRA,
    MultiLoRA,
    PrefixTuning,
    PTuning,
    PromptTuning,
    VeRA,
    load_from_checkpoint,
)
from lightning_peft.peft import (
    adapter_state_dict,
    add_adapter,
    attached,
    inject_adalora,
    inject_boft,
    inject_bottleneck_adapters,
    inject_ia3,
    inject_loha,
    inject_lokr,
    inject_lora,
    inject_p_tuning,
    inject_oft,
    inject_prefix_tuning,
    inject_prompt_tuning,
    inject_vera,
    load_adapter,
    save_adapter,
    set_adapter,
)
from lightning_peft.peft.adapter import adapter_tensors
from tests._models import (
    LORA_ARGS,
    Classifier,
    bert_config,
    bert_model,
    gpt2_model,
    loader,
    padded_loader,
    seeded,
    tensors,
)
from tests._models import trainer as quiet_trainer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# PEFT calls transformers APIs that transformers deprecates (and passes the cache by its old name); not ours.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed from"),  # each resumed run writes elsewhere
]

ADAPTERS = {
    "news": {"rank": 2, "alpha": 4, "target_modules": ["query", "value"]},
    "sport": {"rank": 4, "alpha": 4, "target_modules": ["query", "key"], "init": "gaussian"},
}
BOTTLENECK = {"placement": "houlsby", "reduction_factor": 4, "non_linearity": "gelu", "modules_to_save": ["classifier"]}
PREFIX = {"num_virtual_tokens": 3, "modules_to_save": ["classifier"]}
P_TUNING = {"num_virtual_tokens": 3, "encoder_reparameterization_type": "LSTM", "encoder_hidden_size": 4,
            "encoder_num_layers": 2}  # the LSTM (with its dropout: the resume restores the draws) over the MLP
IA3_ARGS = {"target_modules": ["key", "value", "output.dense"], "feedforward_modules": ["output.dense"]}
VERA_ARGS = {"target_modules": ["query", "value", "intermediate.dense"], "rank": 8}
LOHA_ARGS = {"target_modules": ["query", "value"], "r": 2, "alpha": 4, "rank_dropout": 0.2, "module_dropout": 0.1}
LOKR_ARGS = {"target_modules": ["query", "value"], "r": 2, "alpha": 4, "decompose_both": True}
# masks from step 2 of the straight run's 8, the final one at step 6: the resume (at step 4) needs the allocator's
# state; total_step is given, so that the 1-epoch run follows the 2-epoch schedule
ADALORA_ARGS = {"target_modules": ["query", "value"], "init_r": 4, "target_r": 2, "tinit": 1, "tfinal": 2,
                "total_step": 8}
OFT_ARGS = {"target_modules": ["query", "value", "output.dense"], "oft_block_size": 4}
BOFT_ARGS = {"target_modules": ["query", "value", "output.dense"], "boft_block_size": 4, "boft_n_butterfly_factor": 2}
ROUTES = [["news", "sport", None, "news"], [1, 0, 0, -1], ["sport", "sport", "news", None], [None, "news", 1, "sport"]]


def routed_loader() -> DataLoader:
    """The batches of ``loader()`` as dicts routed to MultiLoRA's adapters by name, id or None (the base)."""
    ids, labels = tensors()
    batches = [{"input_ids": ids[4 * i:4 * i + 4], "labels": labels[4 * i:4 * i + 4], "adapter": route}
               for i, route in enumerate(ROUTES)]
    return DataLoader(batches, batch_size=None)


# ------------------------------------------------------------------------------------------------ the rows


@dataclasses.dataclass(frozen=True)
class Technique:
    """How a technique is switched on under a Trainer and by hand, and what its records look like."""

    callback: Callable[..., Callback]  # (adapter_only_checkpoint=...) -> the callback
    data: Callable[[], DataLoader]
    # id -> (the callback with other settings, the refusal it must raise on resume)
    refused: dict[str, tuple[Callable[..., Callback], str]]
    inject: dict[str, Callable[[nn.Module], Any]]  # family -> inject it by hand, with the pure functions
    peft_config: Callable[[list[str]], Any] | None = None  # LoRA targets -> PEFT's causal-LM config, where PEFT has it
    keeps_float32: bool = False  # its own weights stay float32 when the model is cast to half precision
    record: Callable[[dict], None] = lambda record: None  # extra checks of the checkpoint's lightning_peft record
    folds_on_save: bool = False  # save_adapter (and fit end) write another parametrisation (the table an MLP computes)


def _multi_lora(model: nn.Module, news: list[str], sport: list[str]) -> None:
    inject_lora(model, rank=2, alpha=4, target_modules=news)
    add_adapter(model, "sport", rank=4, alpha=8, target_modules=sport)


def _bottleneck_record(record: dict) -> None:
    assert record["models"]["model"]["bottleneck"]["targets"] == [
        f"bert.encoder.layer.{i}.{s}" for i in (0, 1) for s in ("attention.output.dense", "output.dense")]


TECHNIQUES: dict[str, Technique] = {
    "lora": Technique(
        callback=lambda **kw: LoRA(**LORA_ARGS, **kw),
        data=loader,
        refused={
            "alpha": (lambda **kw: LoRA(**{**LORA_ARGS, "alpha": 16.0}, **kw),
                      r"LoRA: the checkpoint's lora adapter on 'model' was trained with alpha=8\.0; this run has "
                      r"alpha=16\.0\. Resume with the checkpoint's settings"),
            # the shapes differ too: refused before any weight is copied, not by a size mismatch
            "rank": (lambda **kw: LoRA(**{**LORA_ARGS, "rank": 2}, **kw),
                     r"was trained with rank=4(, .*)?; this run has rank=2"),
        },
        inject={"bert": lambda m: inject_lora(m, rank=4, alpha=8, target_modules=["query", "value"]),
                "gpt2": lambda m: inject_lora(m, rank=4, alpha=8, target_modules=["c_attn"])},
        peft_config=lambda targets: peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=targets),
        keeps_float32=True,
    ),
    "lora_dora": Technique(  # LoRA(use_dora=True): a trained magnitude per output feature
        callback=lambda **kw: LoRA(**LORA_ARGS, use_dora=True, **kw),
        data=loader,
        refused={"use_dora": (lambda **kw: LoRA(**LORA_ARGS, **kw),
                              r"was trained with use_dora=True; this run has use_dora=False\. Resume with")},
        inject={"bert": lambda m: inject_lora(m, rank=4, alpha=8, target_modules=["query", "value"], use_dora=True),
                "gpt2": lambda m: inject_lora(m, rank=4, alpha=8, target_modules=["c_attn"], use_dora=True)},
        peft_config=lambda targets: peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=targets,
                                                    use_dora=True),
        keeps_float32=True,
    ),
    "multi_lora": Technique(
        callback=lambda **kw: MultiLoRA(adapters=ADAPTERS, **kw),
        data=routed_loader,
        refused={"sport.rank": (
            lambda **kw: MultiLoRA(adapters={**ADAPTERS, "sport": {**ADAPTERS["sport"], "rank": 3}}, **kw),
            r"the checkpoint's lora adapter on 'model' was trained with sport\.rank=4; this run has sport\.rank=3\. "
            r"Resume with the checkpoint's settings")},
        inject={"bert": lambda m: _multi_lora(m, ["query", "value"], ["key", "dense"]),
                "gpt2": lambda m: _multi_lora(m, ["c_attn"], ["c_proj"])},
        peft_config=lambda targets: peft.LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, target_modules=targets),
        keeps_float32=True,
    ),
    "bottleneck": Technique(
        callback=lambda **kw: BottleneckAdapters(**BOTTLENECK, **kw),
        data=loader,
        refused={"non_linearity": (
            lambda **kw: BottleneckAdapters(**{**BOTTLENECK, "non_linearity": "relu"}, **kw),
            r"BottleneckAdapters: the checkpoint's bottleneck adapter on 'model' was trained with non_linearity='gelu'; "
            r"this run has non_linearity='relu'\. Resume with the checkpoint's settings")},
        inject={family: lambda m: inject_bottleneck_adapters(m, placement="houlsby", non_linearity="gelu_tanh",
                                                             reduction_factor=4)
                for family in ("bert", "gpt2")},
        keeps_float32=True,
        record=_bottleneck_record,  # no peft_config: PEFT has no bottleneck adapters
    ),
    "ia3": Technique(
        callback=lambda **kw: IA3(**IA3_ARGS, **kw),
        data=loader,
        refused={"feedforward_modules": (
            lambda **kw: IA3(target_modules=IA3_ARGS["target_modules"], **kw),
            r"IA3: the checkpoint's ia3 adapter on 'model' was trained with feedforward.*; this run has feedforward")},
        inject={"bert": lambda m: inject_ia3(m, **IA3_ARGS),
                "gpt2": lambda m: inject_ia3(m, target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"])},
        peft_config=lambda targets: peft.IA3Config(task_type="CAUSAL_LM", target_modules=[*targets, "mlp.c_proj"],
                                                   feedforward_modules=["mlp.c_proj"]),
        keeps_float32=True,
    ),
    "vera": Technique(  # the shared projections are buffers: checkpoints carry them beside what trains
        callback=lambda **kw: VeRA(**VERA_ARGS, **kw),
        data=loader,
        refused={"rank": (lambda **kw: VeRA(**{**VERA_ARGS, "rank": 4}, **kw),
                          (r"VeRA: the checkpoint's vera adapter on 'model' was trained with rank=8; this run has "
                           r"rank=4\. Resume with the checkpoint's settings"))},
        inject={"bert": lambda m: inject_vera(m, **VERA_ARGS),
                "gpt2": lambda m: inject_vera(m, target_modules=["c_attn", "mlp.c_proj"], rank=8)},
        peft_config=lambda targets: peft.VeraConfig(task_type="CAUSAL_LM", target_modules=[*targets, "mlp.c_proj"], r=8),
        keeps_float32=True,
    ),
    "loha": Technique(  # GPT-2's layers are transformers Conv1D, which PEFT's LoHa does not adapt: its lm_head
        callback=lambda **kw: LoHa(**LOHA_ARGS, **kw),
        data=loader,
        refused={"r": (lambda **kw: LoHa(**{**LOHA_ARGS, "r": 3}, **kw),
                       r"LoHa: the checkpoint's loha adapter on 'model' was trained with r=2; this run has r=3")},
        inject={"bert": lambda m: inject_loha(m, **LOHA_ARGS), "gpt2": lambda m: inject_loha(m, target_modules=["lm_head"])},
        peft_config=lambda targets: peft.LoHaConfig(task_type="CAUSAL_LM", target_modules=["lm_head"]),
        keeps_float32=True,
    ),
    "lokr": Technique(  # GPT-2's layers are transformers Conv1D, which PEFT's LoKr does not adapt: its lm_head
        callback=lambda **kw: LoKr(**LOKR_ARGS, **kw),
        data=loader,
        refused={"r": (lambda **kw: LoKr(**{**LOKR_ARGS, "r": 1}, **kw),
                       (r"LoKr: the checkpoint's lokr adapter on 'model' was trained with r=2; this run has r=1\. "
                        r"Resume with the checkpoint's settings"))},
        inject={"bert": lambda m: inject_lokr(m, **LOKR_ARGS),
                "gpt2": lambda m: inject_lokr(m, target_modules=["lm_head"])},
        peft_config=lambda targets: peft.LoKrConfig(task_type="CAUSAL_LM", target_modules=["lm_head"]),
        keeps_float32=True,
    ),
    "adalora": Technique(
        callback=lambda **kw: AdaLoRA(**ADALORA_ARGS, **kw),
        data=loader,
        refused={"target_r": (
            lambda **kw: AdaLoRA(**{**ADALORA_ARGS, "target_r": 3}, **kw),
            r"AdaLoRA: the checkpoint's adalora adapter on 'model' was trained with target_r=2; this run has "
            r"target_r=3\. Resume with the checkpoint's settings")},
        inject={"bert": lambda m: inject_adalora(m, target_modules=["query", "value"], init_r=4),
                "gpt2": lambda m: inject_adalora(m, target_modules=["c_attn"], init_r=4)},
        peft_config=lambda targets: peft.AdaLoraConfig(task_type="CAUSAL_LM", target_modules=targets, init_r=4,
                                                       total_step=10),
        keeps_float32=True,
    ),
    "oft": Technique(  # GPT-2's layers are transformers Conv1D, which PEFT's OFT has none for: its embeddings
        callback=lambda **kw: OFT(**OFT_ARGS, **kw),
        data=loader,
        refused={"oft_block_size": (
            lambda **kw: OFT(**{**OFT_ARGS, "oft_block_size": 8}, **kw),
            r"OFT: the checkpoint's oft adapter on 'model' was trained with .*oft_block_size=4.*; this run has .*"
            r"oft_block_size=8")},
        inject={"bert": lambda m: inject_oft(m, **OFT_ARGS),
                "gpt2": lambda m: inject_oft(m, target_modules=["wpe"], oft_block_size=4)},
        peft_config=lambda targets: peft.OFTConfig(task_type="CAUSAL_LM", target_modules=["wpe"], oft_block_size=4),
        keeps_float32=True,
    ),
    "boft": Technique(  # no peft_config: PEFT's GPT-2 layers are Conv1D, which its BOFT has none for
        callback=lambda **kw: BOFT(**BOFT_ARGS, **kw),
        data=loader,
        refused={"boft_n_butterfly_factor": (
            lambda **kw: BOFT(**{**BOFT_ARGS, "boft_n_butterfly_factor": 1}, **kw),
            r"BOFT: the checkpoint's boft adapter on 'model' was trained with .*boft_n_butterfly_factor=2.*; this "
            r"run has .*boft_n_butterfly_factor=1")},
        inject={"bert": lambda m: inject_boft(m, **BOFT_ARGS),
                "gpt2": lambda m: inject_boft(m, target_modules=["lm_head"], boft_block_size=4)},
        keeps_float32=True,
    ),
    "prompt_tuning": Technique(
        callback=lambda **kw: PromptTuning(num_virtual_tokens=4, **kw),
        data=loader,
        refused={"num_virtual_tokens": (
            lambda **kw: PromptTuning(num_virtual_tokens=6, **kw),
            r"trained with num_virtual_tokens=4.*this run has num_virtual_tokens=6")},
        inject={family: lambda m: inject_prompt_tuning(m, num_virtual_tokens=4) for family in ("bert", "gpt2")},
        peft_config=lambda targets: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    ),
    "p_tuning": Technique(  # trains an encoder; save_adapter writes its output (PEFT's file), checkpoints the encoder
        callback=lambda **kw: PTuning(**P_TUNING, encoder_dropout=0.1, **kw),
        data=loader,
        refused={"encoder_hidden_size": (
            lambda **kw: PTuning(**{**P_TUNING, "encoder_hidden_size": 8}, **kw),
            r"PTuning: the checkpoint's p_tuning adapter on 'model' was trained with encoder_hidden_size=4; this run "
            r"has encoder_hidden_size=8")},
        inject={family: lambda m: inject_p_tuning(m, **P_TUNING) for family in ("bert", "gpt2")},
        peft_config=lambda targets: peft.PromptEncoderConfig(task_type="CAUSAL_LM", **P_TUNING),
        folds_on_save=True,
    ),
    "prefix_tuning": Technique(
        callback=lambda **kw: PrefixTuning(**PREFIX, **kw),
        data=padded_loader,
        refused={"num_virtual_tokens": (
            lambda **kw: PrefixTuning(**{**PREFIX, "num_virtual_tokens": 4}, **kw),
            r"PrefixTuning: the checkpoint's prefix_tuning adapter on 'model' was trained with num_virtual_tokens=3; "
            r"this run has num_virtual_tokens=4")},
        inject={family: lambda m: inject_prefix_tuning(m, num_virtual_tokens=3) for family in ("bert", "gpt2")},
        peft_config=lambda targets: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    ),
    "prefix_tuning_projection": Technique(  # trains an MLP over the table; folded into the table at fit end
        callback=lambda **kw: PrefixTuning(**PREFIX, prefix_projection=True, encoder_hidden_size=5, **kw),
        data=padded_loader,
        refused={"prefix_projection": (
            lambda **kw: PrefixTuning(**PREFIX, **kw),
            r"PrefixTuning: the checkpoint's prefix_tuning adapter on 'model' was trained with "
            r"prefix_projection=True.*; this run has prefix_projection=False")},
        inject={family: lambda m: inject_prefix_tuning(m, num_virtual_tokens=3, prefix_projection=True,
                                                       encoder_hidden_size=5)
                for family in ("bert", "gpt2")},
        peft_config=lambda targets: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3,
                                                            prefix_projection=True, encoder_hidden_size=5),
        folds_on_save=True,
    ),
}


def test_every_registered_technique_has_a_row():
    from lightning_peft.peft import adapter

    registered = {kind for kind, cls in adapter._REGISTRY.items() if cls.__module__.startswith("lightning_peft.")}
    covered = {"lora", "bottleneck", "ia3", "vera", "loha", "lokr", "adalora", "p_tuning", "oft", "boft", "prompt_tuning", "prefix_tuning"}  # multi_lora is LoRA's protocol row as well
    assert registered == covered, f"add a conformance row for {sorted(registered - covered)}"
    assert {name.split("_projection")[0] for name in TECHNIQUES} - {"multi_lora", "lora_dora"} == covered


# ------------------------------------------------------------------------------------- Trainer runs (shared)


class Record(Callback):
    """Counts the training steps; keeps each adapter's config as training starts (before any fold at fit end)."""

    def __init__(self) -> None:
        self.steps = 0
        self.configs: dict[str, dict] = {}

    def on_train_start(self, trainer, pl_module):
        self.configs = {kind: a.config_dict() for kind, a in attached(pl_module.model).items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += 1


@dataclasses.dataclass
class Runs:
    straight: Classifier  # 2 epochs, adapter-only checkpoints at each epoch end
    full: Classifier  # 1 epoch, full checkpoints
    resumed: dict[str, Classifier]  # "adapter_only" / "full": from the epoch-0 checkpoint of the runs above
    steps: dict[str, int]  # optimizer steps the resumed runs took
    configs: dict[str, dict]  # the straight run's adapter configs as it started
    ckpt: dict[str, Path]  # "adapter_only" / "full": the epoch-0 checkpoints


def fit(technique: Technique, root: Path, epochs: int, adapter_only: bool, ckpt_path=None, callback=None):
    torch.manual_seed(0)
    module = Classifier(bert_config())
    record = Record()
    callbacks = [callback or technique.callback(adapter_only_checkpoint=adapter_only), record,
                 ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)]
    quiet_trainer(root, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=True).fit(
        module, technique.data(), ckpt_path=ckpt_path)
    return module, record


# The DoRA row's Trainer fits (about 10 s) only run with the slow tests: DoRA changes the layer, not the protocol, and
# its layer is checked against PEFT in tests/peft/lora/test_variants.py.
@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n == "lora_dora" else n
                                        for n in TECHNIQUES])
def runs(request, tmp_path_factory) -> tuple[str, Runs]:
    name, technique = request.param, TECHNIQUES[request.param]
    root = tmp_path_factory.mktemp(name)
    straight, record = fit(technique, root / "straight", 2, adapter_only=True)
    full, _ = fit(technique, root / "full", 1, adapter_only=False)
    ckpt = {"adapter_only": root / "straight" / "epoch=0.ckpt", "full": root / "full" / "epoch=0.ckpt"}
    resumed, steps = {}, {}
    for kind, path in ckpt.items():
        resumed[kind], resumed_record = fit(technique, root / f"resumed-{kind}", 2, kind == "adapter_only",
                                            ckpt_path=path)
        steps[kind] = resumed_record.steps
    return name, Runs(straight, full, resumed, steps, record.configs, ckpt)


@pytest.mark.parametrize("kind", ["adapter_only", "full"])
def test_a_resumed_run_equals_the_straight_run_bit_for_bit(runs, kind):
    _, run = runs
    assert run.steps[kind] == 4  # it ran the second epoch only: it did resume
    reference = run.straight.state_dict()
    resumed = run.resumed[kind].state_dict()
    assert resumed.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), key
    head = "model.classifier.trained_module.weight"
    assert not torch.equal(reference[head], run.full.state_dict()[head])  # the second epoch trained


def test_an_adapter_only_checkpoint_holds_what_trains_alone_and_is_smaller(runs):
    name, run = runs
    adapter_only = torch.load(run.ckpt["adapter_only"], weights_only=False)
    full = torch.load(run.ckpt["full"], weights_only=False)
    trained = run.straight.trainable_names_at_configure
    assert "model.classifier.trained_module.weight" in trained  # the task head is the adapter's too
    buffers = {f"model.{k}" for k, v in adapter_tensors(run.straight.model).items() if not isinstance(v, nn.Parameter)}
    assert set(adapter_only["state_dict"]) == trained | buffers  # nothing but the adapter (VeRA's buffers) and the head
    if not TECHNIQUES[name].folds_on_save:
        assert trained | buffers == {f"model.{k}" for k in adapter_state_dict(run.straight.model)}
    assert trained < set(full["state_dict"]) and "model.bert.embeddings.word_embeddings.weight" in full["state_dict"]
    assert run.ckpt["adapter_only"].stat().st_size < run.ckpt["full"].stat().st_size
    for saved in (adapter_only, full):
        assert set(attached(run.straight.model)) <= set(saved["lightning_peft"]["models"]["model"])
        TECHNIQUES[name].record(saved["lightning_peft"])


@pytest.mark.parametrize("kind", ["adapter_only", "full"])
def test_load_from_checkpoint_rebuilds_the_trained_model(runs, kind):
    _, run = runs
    trained, path = (run.straight, run.ckpt["adapter_only"].with_name("epoch=1.ckpt")) if kind == "adapter_only" else (
        run.full, run.ckpt["full"])
    torch.manual_seed(0)  # an adapter-only checkpoint takes the frozen base from the module as built
    loaded = load_from_checkpoint(Classifier, path, config=bert_config())
    assert type(loaded) is Classifier
    adapters, expected = attached(loaded.model), attached(trained.model)
    assert adapters.keys() == expected.keys()
    for kind, adapter in adapters.items():
        assert adapter.config_dict() == run.configs[kind]  # as trained (a prefix MLP is folded only at fit end)
        assert sorted(adapter.wrapped(loaded.model)) == sorted(expected[kind].wrapped(trained.model))
    ids, mask, _ = next(iter(padded_loader()))
    trained.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids, attention_mask=mask).logits,
                           trained.model(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.parametrize("kind", ["adapter_only", "full"])
def test_resuming_with_other_settings_is_refused_naming_both_values(runs, kind, tmp_path):
    name, run = runs
    for other, message in TECHNIQUES[name].refused.values():
        with pytest.raises(ValueError, match=message):
            fit(TECHNIQUES[name], tmp_path, 2, kind == "adapter_only", ckpt_path=run.ckpt[kind],
                callback=other(adapter_only_checkpoint=kind == "adapter_only"))


# ---------------------------------------------------------------------------------- save/load, PEFT format

# One causal LM, on which every technique has a PEFT form (PEFT's own BERT classifier forward fails with a prefix);
# GPT-2's Conv1D layers are LoRA's transposed case. The per-family details live in tests/peft.
FAMILIES = {"gpt2": gpt2_model}
PEFT_TARGETS = {"gpt2": ["c_attn"]}


def base(family: str) -> nn.Module:
    return seeded(FAMILIES[family])


def inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(7))  # (B, T)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def logits(model: nn.Module) -> torch.Tensor:
    """A classifier's logits, or a causal LM's at the real tokens (prompt tuning returns the virtual ones too)."""
    with torch.no_grad():
        out = model(**inputs()).logits
    return out[:, -inputs()["input_ids"].shape[1]:] if out.dim() == 3 else out


@torch.no_grad()
def randomise(tensors: list[torch.Tensor], seed: int = 1) -> None:
    """Random values exactly representable in float32 (PEFT keeps some adapter tensors in float32)."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in tensors:
        tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))


def adapted(name: str, family: str) -> tuple[nn.Module, nn.Module]:
    """(the base, a copy with the technique injected by hand and random adapter values)."""
    plain = base(family)
    model = copy.deepcopy(plain)
    TECHNIQUES[name].inject[family](model)
    state = adapter_state_dict(model)
    randomise([state[k] for k in sorted(state)])
    model.eval()
    assert (logits(model) - logits(plain)).abs().max() > 1e-3, "the adapter is a no-op: the check would be vacuous"
    return plain, model


def each_adapter(name: str, model: nn.Module):
    """Yields once per named LoRA adapter of the multi-LoRA row (set active), once (None) for the others."""
    for adapter_name in (["default", "sport"] if name == "multi_lora" else [None]):
        if adapter_name is not None:
            set_adapter(model, adapter_name)
        yield adapter_name


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", list(TECHNIQUES))
def test_save_then_load_into_a_fresh_base_is_exact(name, family, tmp_path):
    plain, model = adapted(name, family)
    save_adapter(model, tmp_path)
    loaded = load_adapter(copy.deepcopy(plain), tmp_path)
    if not TECHNIQUES[name].folds_on_save:
        ours, theirs = adapter_state_dict(model), adapter_state_dict(loaded)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for _ in zip(each_adapter(name, model), each_adapter(name, loaded)):
        assert torch.equal(logits(loaded), logits(model))


def peft_from_pretrained(plain: nn.Module, path: Path, adapter_name: str = "default") -> nn.Module:
    torch.set_default_dtype(torch.float64)  # PEFT builds its prompt encoder in the default dtype, then loads into it
    try:
        return peft.PeftModel.from_pretrained(plain, path, adapter_name=adapter_name).eval()
    finally:
        torch.set_default_dtype(torch.float32)


PEFT_ROWS = [(name, family) for name, t in TECHNIQUES.items() if t.peft_config for family in PEFT_TARGETS]


@pytest.mark.parametrize(("name", "family"), PEFT_ROWS)
def test_peft_loads_our_adapter_with_our_outputs(name, family, tmp_path):
    plain, model = adapted(name, family)
    save_adapter(model, tmp_path)
    for adapter_name in each_adapter(name, model):
        where = tmp_path / "sport" if adapter_name == "sport" else tmp_path
        theirs = peft_from_pretrained(copy.deepcopy(plain), where)
        torch.testing.assert_close(logits(theirs), logits(model), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("name", "family"), PEFT_ROWS)
def test_we_load_a_peft_adapter_with_its_outputs(name, family, tmp_path):
    plain = base(family)
    torch.set_default_dtype(torch.float64)
    try:
        theirs = peft.get_peft_model(copy.deepcopy(plain), TECHNIQUES[name].peft_config(PEFT_TARGETS[family]))
        if name == "multi_lora":
            theirs.add_adapter("sport", peft.LoraConfig(task_type="CAUSAL_LM", r=3, lora_alpha=3,
                                                        target_modules=PEFT_TARGETS[family][:1]))
    finally:
        torch.set_default_dtype(torch.float32)
    randomise([p for n, p in sorted(theirs.named_parameters())
               if "lora_" in n or "ia3_l" in n or "prompt_encoder" in n or "vera_lambda" in n or "hada_" in n
               or "lokr_" in n or ".oft_" in n])
    theirs.eval().save_pretrained(tmp_path)
    ours = load_adapter(copy.deepcopy(plain), tmp_path).eval()
    assert (logits(ours) - logits(plain)).abs().max() > 1e-3  # not vacuous
    for adapter_name in (["default", "sport"] if name == "multi_lora" else [None]):
        if adapter_name is not None:
            theirs.set_adapter(adapter_name)
            set_adapter(ours, adapter_name)
        torch.testing.assert_close(logits(ours), logits(theirs), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------- dtype casts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("name", list(TECHNIQUES))
def test_a_cast_of_the_whole_model(name, dtype):
    torch.manual_seed(0)
    model = bert_model().eval()
    TECHNIQUES[name].inject["bert"](model)
    own = {k: v for k, v in adapter_state_dict(model).items() if ".classifier." not in f".{k}"}  # not the head
    before = {k: v.detach().clone() for k, v in own.items()}
    model.to(dtype)
    after = adapter_state_dict(model)
    assert model.bert.embeddings.word_embeddings.weight.dtype == dtype
    for key, value in before.items():
        if dtype == torch.float64 or not TECHNIQUES[name].keeps_float32:
            assert after[key].dtype == dtype, key  # float64 reference runs reach the adapter too
        else:
            assert after[key].dtype == torch.float32 and torch.equal(after[key], value), key  # not rounded
    assert model(**inputs()).logits.dtype == dtype
