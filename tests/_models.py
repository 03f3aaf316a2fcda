"""Tiny models, loaders and Trainer defaults the tests share (no weights are ever downloaded).

One place for what the test files used to import from each other (``tests.callbacks.test_lora``'s ``Classifier``,
``loader`` and ``trainer``, ``tests.callbacks.test_rng.ResumableLoader``) and for the tiny Hugging Face configs and
models (``bert_model``, ``gpt2_model``, ``llama_model``) that files used to build with a ``_bert()`` of their own.
Everything here is deterministic: the data comes from its own ``torch.Generator``, so a loader gives the same batches
whatever the global seed.

Importing this module does not import Lightning (the tests of the pure layers use it too): ``Classifier`` is built
on first access and ``trainer`` imports Lightning when called.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

VOCAB = 64
# The tiny BERT's shape: 2 layers of width 16, 2 heads; 64 tokens, 32 positions.
BERT_SHAPE = {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 32, "max_position_embeddings": 32}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
LORA_ARGS = {"rank": 4, "alpha": 8.0, "target_modules": ["query", "value"], "modules_to_save": ["classifier"]}


# ------------------------------------------------------------------------------------------- configs and models


def bert_config(**overrides: Any):
    """The tiny BERT of ``tests/conftest.py``'s ``tiny_bert_config``: 3 labels, dropout off unless overridden."""
    from transformers import BertConfig

    return BertConfig(**{**BERT_SHAPE, "num_labels": 3, **NO_DROPOUT, **overrides})


def gpt2_config(**overrides: Any):
    """A 2-layer GPT-2 of width 16 (2 heads, 32 positions), dropout off."""
    from transformers import GPT2Config

    return GPT2Config(**{"vocab_size": VOCAB, "n_positions": 32, "n_embd": 16, "n_layer": 2, "n_head": 2,
                         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **overrides})


def llama_config(**overrides: Any):
    """A 2-layer Llama of width 16 with one key/value head (v_proj (8, 16), q_proj (16, 16))."""
    from transformers import LlamaConfig

    return LlamaConfig(**{"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
                          **overrides})


def bert_model(task: str = "seq_cls", **overrides: Any) -> nn.Module:
    """A random BERT of :func:`bert_config` (``overrides`` go to the config) with ``task``'s head: ``"base"``
    (``BertModel``), ``"seq_cls"``, ``"masked_lm"`` or ``"qa"``; in train mode, as transformers builds it."""
    import transformers

    heads = {"base": transformers.BertModel, "seq_cls": transformers.BertForSequenceClassification,
             "masked_lm": transformers.BertForMaskedLM, "qa": transformers.BertForQuestionAnswering}
    return heads[task](bert_config(**overrides))


def gpt2_model(**overrides: Any) -> nn.Module:
    """A random ``GPT2LMHeadModel`` of :func:`gpt2_config` (``overrides`` go to the config), in train mode."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(gpt2_config(**overrides))


def tied_gpt2() -> nn.Module:
    """A one-layer GPT-2 of width 8 (32 tokens, 16 positions) seeded 0, in eval mode: its head is its input
    embedding (GPT-2 ties them), for the tied-weight tests."""
    torch.manual_seed(0)
    return gpt2_model(vocab_size=32, n_embd=8, n_layer=1, n_positions=16).eval()


def llama_model(task: str = "causal_lm", **overrides: Any) -> nn.Module:
    """A random Llama of :func:`llama_config` (``overrides`` go to the config) with ``task``'s head: ``"causal_lm"``
    or ``"seq_cls"``; in train mode."""
    import transformers

    heads = {"causal_lm": transformers.LlamaForCausalLM, "seq_cls": transformers.LlamaForSequenceClassification}
    return heads[task](llama_config(**overrides))


def seeded(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """``build()`` after ``torch.manual_seed(seed)``, in float64 and eval mode: the base of the exact comparisons."""
    torch.manual_seed(seed)
    return build().double().eval()


def reloaded(base: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
    """A new, un-adapted ``build()`` (float64, eval mode) holding ``base``'s weights, loaded through its state dict
    over another random start (seed 1234), so that nothing but the load can make it equal ``base``."""
    model = seeded(build, seed=1234)
    model.load_state_dict(base.state_dict(), strict=True)
    return model


class Tiny(nn.Module):
    """Two blocks of linear layers plus a head; names like a transformer's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"query": nn.Linear(6, 6), "value": nn.Linear(6, 6), "norm": nn.LayerNorm(6)}) for _ in range(2)
        )
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, T, 6)
        for block in self.blocks:
            h = block["norm"](h + block["query"](h).tanh() * block["value"](h))
        return self.head(h.mean(1))  # (B, 3)


def conv1d(n_in: int, n_out: int) -> nn.Module:
    """A transformers ``Conv1D`` (weight (in, out)) with random weight and bias."""
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(n_out, n_in)
    nn.init.normal_(layer.weight)
    nn.init.normal_(layer.bias)
    return layer


def randomise(layers) -> None:
    """Give every adapter of these LoRA layers non-zero values, so that no check passes because B starts at zero."""
    with torch.no_grad():
        for layer in layers.values() if isinstance(layers, dict) else layers:
            for param in layer.adapter_parameters().values():
                param.normal_(0.0, 0.5)


def save_tiny_bert(path: Path, seed: int = 0, **overrides: Any) -> str:
    """A random ``BertModel`` of the tiny shape (Hugging Face's default dropout and labels) saved with
    ``save_pretrained`` at ``path``, for code that loads by name; returns the path as a string."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    BertModel(BertConfig(**{**BERT_SHAPE, **overrides})).save_pretrained(path)
    return str(path)


def save_llama(directory: Path | str, seed: int = 0, **overrides: Any) -> str:
    """A random ``LlamaForCausalLM`` of :func:`llama_config` (``overrides`` go to the config), seeded, written as
    ``save_pretrained`` lays it out (``config.json``, ``model.safetensors``) on every process: transformers'
    ``save_pretrained`` writes nothing on a rank other than 0 once ``torch.distributed`` is initialised. Returns the
    directory as a string."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = llama_model(**overrides)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(directory / "config.json")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    return str(directory)


# ------------------------------------------------------------------------------------------------------ data


def tensors(samples: int = 16, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (samples, length), labels (samples,))`` drawn from a generator seeded 1: 3 classes."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (samples, length), generator=generator)
    return ids, torch.randint(0, 3, (samples,), generator=generator)


def dataset() -> TensorDataset:
    return TensorDataset(*tensors())


def loader() -> DataLoader:
    """16 samples of 8 tokens, 4 batches of ``(ids, labels)`` in order."""
    return DataLoader(dataset(), batch_size=4, shuffle=False)


def padded_loader() -> DataLoader:
    """The batches of :func:`loader` as ``(ids, mask, labels)``: the last two tokens of every other row are padding."""
    ids, labels = tensors()
    mask = torch.ones_like(ids)
    mask[::2, -2:] = 0
    return DataLoader(TensorDataset(ids, mask, labels), batch_size=4, shuffle=False)


def dict_loader() -> DataLoader:
    """The batches of :func:`loader` as dicts (``input_ids``, ``attention_mask`` of ones, ``labels``)."""
    ids, labels = tensors()
    rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, labels)]
    return DataLoader(rows, batch_size=4)


def indexed_data(n: int = 16) -> TensorDataset:
    """``(ids, labels, index)`` samples: the tensors of :func:`tensors` and each sample's position."""
    ids, labels = tensors(n)
    return TensorDataset(ids, labels, torch.arange(n))


def token_sum(sample) -> float:
    """A curriculum scorer for (ids, labels, index) samples: the sum of the token ids."""
    return float(sample[0].sum())


class _Tail(Sampler):
    """Indices in order from ``start`` on; counts what it handed out (the loader's state)."""

    def __init__(self, size: int) -> None:
        self.size, self.start, self.position = size, 0, 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        self.position, self.start = self.start, 0
        while self.position < self.size:
            self.position += 1
            yield self.position - 1


class ResumableLoader(DataLoader):
    """A real ``DataLoader`` (its iterator draws its seed from the global generator, as every one does) that resumes
    mid-epoch where the checkpoint left it: Lightning calls ``state_dict`` / ``load_state_dict`` on it."""

    def __init__(self, dataset, batch_size: int) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=_Tail(len(dataset)))

    def state_dict(self) -> dict[str, int]:
        position = self.sampler.position
        return {"position": position if position < len(self.sampler) else 0}  # at the end: the next epoch's start

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.start = state["position"]


# --------------------------------------------------------------------------------------------------- trainer


def trainer(tmp_path, **kwargs):
    """A quiet one-process CPU Trainer (no logger, progress bar, summary or checkpoints unless asked)."""
    import lightning.pytorch as pl

    defaults = {
        "accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
        "enable_model_summary": False, "enable_checkpointing": False, "default_root_dir": tmp_path,
    }
    return pl.Trainer(**{**defaults, **kwargs})


# ------------------------------------------------------------------------------------------- LightningModules


def _classifier():
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        """A tiny BERT classifier: the Hugging Face model sits at ``self.model``, as in user code.

        Batches are ``(ids, labels)``, ``(ids, attention_mask, labels)`` or dicts with ``input_ids``, ``labels`` and
        optionally ``attention_mask`` (other keys, such as MultiLoRA's ``adapter``, are the callbacks'). It records what
        the optimizer got: ``trainable_at_configure`` (a count) and ``trainable_names_at_configure``.
        """

        def __init__(self, config, lr: float = 0.05, weight_decay: float = 0.01) -> None:
            super().__init__()
            from transformers import BertForSequenceClassification

            self.model = BertForSequenceClassification(config)
            self.lr, self.weight_decay = lr, weight_decay
            self.trainable_at_configure: int | None = None
            self.trainable_names_at_configure: set[str] | None = None

        def loss(self, batch) -> torch.Tensor:
            if isinstance(batch, dict):
                ids, mask, labels = batch["input_ids"], batch.get("attention_mask"), batch["labels"]
            else:
                ids, *masks, labels = batch
                mask = masks[0] if masks else None
            return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss

        def training_step(self, batch, batch_idx):
            return self.loss(batch)

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self.loss(batch))

        def configure_optimizers(self):
            trainable = {n: p for n, p in self.named_parameters() if p.requires_grad}
            self.trainable_at_configure = sum(p.numel() for p in trainable.values())
            self.trainable_names_at_configure = set(trainable)
            return torch.optim.AdamW(list(trainable.values()), lr=self.lr, weight_decay=self.weight_decay)

    Classifier.__qualname__ = "Classifier"
    return Classifier


def _indexed():
    class Indexed(__getattr__("Classifier")):
        """The tiny BERT classifier, recording the sample indices of every batch it trains on (``indexed_data``).

        With ``estimate=True`` it asks for ``estimated_stepping_batches`` in ``configure_optimizers`` (as
        ``HFSequenceClassifier`` does), which makes Lightning build the train loader before the training state is
        restored.
        """

        def __init__(self, config, lr: float = 0.05, estimate: bool = False) -> None:
            super().__init__(config, lr)
            self.seen: list[list[int]] = []
            self.estimate = estimate

        def training_step(self, batch, batch_idx):
            ids, labels, index = batch
            self.seen.append(index.tolist())
            return self.model(input_ids=ids, labels=labels).loss

        def configure_optimizers(self):
            if self.estimate:
                assert self.trainer.estimated_stepping_batches > 0
            return super().configure_optimizers()

    Indexed.__qualname__ = "Indexed"
    return Indexed


_LAZY = {"Classifier": _classifier, "Indexed": _indexed}


def __getattr__(name: str):
    """``Classifier`` subclasses ``LightningModule``: built (and Lightning imported) on first use only."""
    if name in _LAZY:
        value = globals()[name] = _LAZY[name]()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------- Lightning blocked

# Run first in a fresh interpreter, it makes any import of Lightning fail: the pure layers must not need it.
BLOCK_LIGHTNING = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric'):
            raise ImportError(f'blocked import of {name}')
sys.meta_path.insert(0, Block())
"""


def run_with_lightning_blocked(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which importing Lightning raises ImportError."""
    return subprocess.run([sys.executable, "-c", BLOCK_LIGHTNING + code], capture_output=True, text=True, timeout=120)
