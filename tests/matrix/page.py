"""Writes ``docs/compatibility.md`` and the README's per-strategy lines from the matrix's outcomes (never by hand).

``MATRIX_RESULTS=/tmp/m.json pytest tests/matrix`` keeps the outcomes of a run in a file;
``python -m tests.matrix.page /tmp/m.json`` then writes the page and the README block from it. ``test_matrix.py``
checks that both are what this writes from the outcomes of its own run.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tests.matrix.cells import COLUMNS, REFERENCE, ROWS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"

HEADER = """# Compatibility: every callback under every strategy

Written by `tests/matrix/page.py` from the outcomes of `tests/matrix/test_matrix.py`, which CI runs; a test fails
when this page and the outcomes differ. Do not edit it by hand.

Each cell trains a few optimizer steps of a tiny model (a Hugging Face BERT; the project's `TransformerEncoder`
where the pipeline cuts it and for token pruning; for LoRA on `nn.MultiheadAttention` a plain-PyTorch classifier of
`nn.TransformerEncoderLayer`s, and for LoRA on MoE experts a transformers Mixtral, both run as they are under the
pipeline, which cuts neither) written the way existing projects write a LightningModule:
every parameter grouped by name in `configure_optimizers` (frozen ones too), a linear warm-up schedule over
`trainer.estimated_stepping_batches` stepped per step, torchmetrics accuracy, `sync_dist` logging. Training-dynamics
rows run with LoRA. One row runs another LightningModule: `HFCausalLM` (a tiny transformers Llama) on packed SFT batches
(`SFTDataModule(packing=True)`'s layout), a different number of target tokens on each data-parallel rank, so it equals
the one-process run only if the loss is the token mean of the global batch. A cell has two allowed outcomes:

- **equal** — the exported adapter (and merged model) and the validation metrics equal the one-process run on the
  same global batch, within {tolerance} (tensor parallelism: {tp_tolerance}). Data-parallel strategies split the
  batch over 2 ranks; tensor and pipeline parallelism give both ranks of a group the same batch.
- **refused** — an error at setup, before the first batch, naming both parts and why.

A third outcome, running and differing, fails the test. The all-in-one row is LoRA + LayerwiseLRDecay +
GradientAccumulation (global batch of 2 micro-batches) + Curriculum + GradientNoise + MergeOnSave. Below the grid,
the resume check: the all-in-one cell with dropout on (the model's and LoRA's), resumed from a checkpoint after the
first optimizer step, equals the straight run, for each strategy family.

## The contract at the seams

Callbacks ask the strategy, never the trainer, through one module, `lightning_peft._seams`:
`data_parallel(strategy)` is the data-parallel size and rank (from `strategy.distributed_sampler_kwargs`: under the
pipeline every rank reads the same batch, under tensor parallelism the ranks of one group do; one device and the
device map are `(1, 0)`), which `Curriculum` and `GradientAccumulation(global_batch_size=...)` use;
`strategy_family(strategy)` says where gradients live (`plain`, `dtensor`, `deepspeed`), and
`lightning_peft._grads` reads and changes them there (DTensor shards, DeepSpeed's partitions, where `p.grad` is
None), so elementwise work such as `GradientNoise` gives every element the same value whatever the partitioning;
`splits_layers(strategy)` and `tensor_parallel_size(strategy)` say whether a rank holds whole layers; `refuse(...)`
is the one error for a pair that cannot run, raised at setup.
"""


def write(results: dict[str, dict[str, dict[str, object]]], tolerances: dict[str, float]) -> str:
    """The page for ``results[row][column] = {"outcome": "equal" | "refused", "reason": ...}``."""
    lines = [HEADER.format(tolerance=tolerances["default"], tp_tolerance=tolerances["tensor parallel"]), ""]
    columns = [c.name for c in COLUMNS]
    lines.append("| callback | " + " | ".join(columns) + " |")
    lines.append("| --- | " + " | ".join(":---:" for _ in columns) + " |")
    reasons: list[str] = []
    for row in ROWS:
        cells = []
        for column in columns:
            cell = results[row.name][column]
            if column == REFERENCE.name and cell["outcome"] == "equal":
                cells.append("reference")
            elif cell["outcome"] == "equal":
                cells.append("equal")
            else:
                reason = _reason(str(cell["reason"]))
                if reason not in reasons:
                    reasons.append(reason)
                cells.append(f"refused [{reasons.index(reason) + 1}]")
        lines.append(f"| {row.name} | " + " | ".join(cells) + " |")
    lines += ["", "## Why a cell is refused", ""]
    lines += [f"{i}. {reason}" for i, reason in enumerate(reasons, 1)]
    lines += ["", "## By strategy", "", *summary(results)]
    resume = results.get("resume", {})
    if resume:
        lines += ["", "## Resume (all-in-one, dropout on)", "", "| strategy | resumed == straight |", "| --- | :---: |"]
        lines += [f"| {name} | {'yes' if ok else 'no'} |" for name, ok in resume.items()]
    return "\n".join(lines) + "\n"


def summary(results: dict[str, dict[str, dict[str, object]]]) -> list[str]:
    """One line per strategy: what it refuses (the README carries these lines too, checked by the test)."""
    reasons: list[str] = []
    for row in ROWS:  # numbered as on the page
        for column in COLUMNS:
            cell = results[row.name][column.name]
            if cell["outcome"] == "refused" and _reason(str(cell["reason"])) not in reasons:
                reasons.append(_reason(str(cell["reason"])))
    lines = []
    for column in COLUMNS:
        refused = [(row.name, reasons.index(_reason(str(results[row.name][column.name]["reason"]))) + 1)
                   for row in ROWS if results[row.name][column.name]["outcome"] == "refused"]
        if not refused:
            lines.append(f"- **{column.name}**: runs every callback of the grid.")
        else:
            named = ", ".join(f"{name} [{index}]" for name, index in refused)
            lines.append(f"- **{column.name}**: refuses {named}; runs the rest.")
    return lines


def _reason(error: str) -> str:
    """The error message without what changes from run to run (paths, addresses)."""
    error = re.sub(r"/\S+", "<path>", error)
    return error.replace("|", "\\|").replace("\n", " ")


README = PAGE.parents[1] / "README.md"
START, END = "<!-- compatibility:start -->\n", "<!-- compatibility:end -->"


def main(path: str) -> None:
    """Writes the page and the README's per-strategy lines from a results file."""
    data = json.loads(Path(path).read_text())
    PAGE.write_text(write(data["results"], data["tolerances"]))
    head, rest = README.read_text().split(START, 1)
    README.write_text(head + START + "\n".join(summary(data["results"])) + "\n" + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    main(sys.argv[1])
