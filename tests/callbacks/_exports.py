"""What a PEFT callback's ``MergeOnSave`` run must export, checked once for every technique's callback test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.testing import assert_close

from tests._models import Classifier


def assert_merge_on_save_exports(config, out: Path, fit: Callable[[], nn.Module],
                                 layers: Callable[[nn.Module], dict]) -> None:
    """``fit()`` (a LightningModule trained with ``MergeOnSave(dirpath=out)``) wrote a merged model that plain
    transformers loads (with no adapter ``layers`` left) and an adapter PEFT loads on the base, both with the trained
    model's logits."""
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
    theirs = PeftModel.from_pretrained(base, out / "adapter").eval()
    assert_close(theirs(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)
