"""What every PEFT technique's callback test checks, written once: a run with the callback, a resume from an
adapter-only checkpoint, the ``MergeOnSave`` exports, and the callback built from LightningCLI YAML."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.testing import assert_close

from tests._models import Classifier, loader, trainer


def fit(callback: Callback, config, root: Path, epochs: int = 1, ckpt_path=None, callbacks=()) -> nn.Module:
    """A `Classifier` trained with ``callback`` for ``epochs`` from seed 0, a checkpoint after every epoch in
    ``root`` (``epoch=<n>.ckpt``)."""
    torch.manual_seed(0)
    module = Classifier(config)
    checkpoint = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)
    run = trainer(root, max_epochs=epochs, callbacks=[callback, checkpoint, *callbacks], enable_checkpointing=True)
    run.fit(module, loader(), ckpt_path=ckpt_path)
    return module


def assert_resumes_bit_for_bit(fit: Callable[..., nn.Module], root: Path, more: frozenset[str] = frozenset()) -> None:
    """``fit(root, epochs, ckpt_path=None)`` (with an ``adapter_only_checkpoint`` callback) saves only the trainable
    tensors (and ``more``), and a run resumed from its first epoch equals the straight run to the bit."""
    straight = fit(root / "straight", 2)
    saved = torch.load(root / "straight" / "epoch=0.ckpt", weights_only=False)
    assert set(saved["state_dict"]) == straight.trainable_names_at_configure | more
    resumed = fit(root / "resumed", 2, ckpt_path=root / "straight" / "epoch=0.ckpt")
    reference = straight.state_dict()
    assert resumed.state_dict().keys() == reference.keys()
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in reference.items())


def assert_merge_on_save_exports(config, out: Path, fit: Callable[[], nn.Module],
                                 layers: Callable[[nn.Module], dict], peft_warns: str | None = None) -> None:
    """``fit()`` (a LightningModule trained with ``MergeOnSave(dirpath=out)``) wrote a merged model that plain
    transformers loads (with no adapter ``layers`` left) and an adapter PEFT loads on the base (``peft_warns``: the
    warning PEFT gives then), both with the trained model's logits."""
    import transformers
    from peft import PeftModel

    torch.manual_seed(0)
    base_state = {k: v.clone() for k, v in Classifier(config).model.state_dict().items()}
    module = fit()
    ids = torch.randint(0, 64, (3, 8))
    module.model.eval()
    expected = module.model(input_ids=ids).logits
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(out / "merged").eval()
    assert type(merged) is transformers.BertForSequenceClassification and not layers(merged)
    assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)
    base = transformers.BertForSequenceClassification(config)
    base.load_state_dict(base_state)
    with pytest.warns(UserWarning, match=peft_warns) if peft_warns else contextlib.nullcontext():
        theirs = PeftModel.from_pretrained(base, out / "adapter").eval()
    assert_close(theirs(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)


def from_cli_yaml(callback_class: type, init_args: str) -> Callback:
    """``callback_class`` built as LightningCLI builds it from a YAML ``callback:`` entry with ``init_args`` (a YAML
    flow mapping's contents: ``"target_modules: [query], ..."``)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callback", type=callback_class)
    yaml = (f"callback:\n  class_path: lightning_peft.callbacks.{callback_class.__name__}\n"
            f"  init_args: {{{init_args}}}\n")
    return parser.instantiate_classes(parser.parse_string(yaml)).callback
