"""The teacher of a curriculum's transfer scoring: a Hugging Face sequence classifier saved with ``save_pretrained``.

Paper: Hacohen & Weinshall, arXiv:1904.03626: a teacher trained on the same task ranks the data by its per-sample loss
([`LossScorer`][lightning_peft.training.LossScorer]). A teacher that trained a few steps, or stopped before its run's
end, ranks the data close to an untrained model: `teacher_report` says how long the teacher trained, from the training
record written next to the export (``MergeOnSave`` writes one).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["MIN_TEACHER_STEPS", "check_teacher", "load_teacher", "teacher_report"]

MIN_TEACHER_STEPS = 100


def check_teacher(teacher: object, scorer: object, who: str = "Curriculum") -> None:
    """Raises unless ``teacher`` is None, or a path and ``scorer`` is ``"loss"`` (a teacher scores by its loss)."""
    if teacher is None:
        return
    if not isinstance(teacher, str):
        raise TypeError(f"{who}(teacher={teacher!r}): teacher must be the path of a model directory, or None.")
    if scorer != "loss":
        raise ValueError(f"{who}(scorer={scorer!r}, teacher={teacher!r}): a teacher scores by its loss; set scorer='loss'.")


def load_teacher(directory: str, who: str = "Curriculum") -> Any:
    """The Hugging Face sequence classifier saved in ``directory``, frozen, in eval mode.

    Look for the directory when the data is scored (before the first step), not when a config is read: a config
    naming the output of an earlier run must parse before that run has happened.

    Raises:
        ValueError: If ``directory`` is not a directory, or holds no sequence classifier.
        RuntimeError: If the ``transformers`` package is missing.
    """
    if not os.path.isdir(directory):
        raise ValueError(
            f"{who}(teacher={directory!r}): no such directory; give a directory written by save_pretrained "
            "(MergeOnSave writes one as <dirpath>/merged, e.g. artifacts/minilm_bbc/merged after `make demo`)."
        )
    try:
        from transformers import AutoModelForSequenceClassification
    except ImportError as error:
        raise RuntimeError(
            f"{who}(teacher=...) loads a Hugging Face model and needs the transformers package; install it "
            "with `pip install 'lightning-peft[hf]'`."
        ) from error
    try:
        model = AutoModelForSequenceClassification.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{who}(teacher={directory!r}): not a Hugging Face sequence classifier directory ({error})."
        ) from error
    return model.eval().requires_grad_(False)


def teacher_report(directory: str, record_file: str, who: str = "Curriculum") -> tuple[str, str | None]:
    """``(what to tell, what to warn of or None)`` about the teacher in ``directory``, from its training record.

    ``record_file`` is the record's file name in ``directory`` (JSON with ``optimizer_steps`` and, optionally,
    ``planned_steps``). A teacher that trained under `MIN_TEACHER_STEPS` steps, or fewer than its run planned,
    is warned of.
    """
    record_path = os.path.join(directory, record_file)
    record = None
    if os.path.isfile(record_path):
        with open(record_path) as handle:
            record = json.load(handle)
    where = os.path.abspath(directory)
    if record is None:
        return f"{who}: scoring with the teacher in {where} (no training record: not written by MergeOnSave).", None
    steps, planned = record.get("optimizer_steps"), record.get("planned_steps")
    told = f"{steps} optimizer steps" + (f" of the {planned} its run planned" if planned else "")
    info = f"{who}: scoring with the teacher in {where}, trained for {told}."
    if isinstance(steps, int) and (steps < MIN_TEACHER_STEPS or (isinstance(planned, int) and steps < planned)):
        return info, (
            f"{who}(teacher={directory!r}): the teacher trained for {told}; an undertrained teacher ranks the "
            "data close to an untrained model, and the curriculum then orders it almost at random. Train the teacher "
            "to its end first (e.g. `make demo` for artifacts/minilm_bbc/merged), or use scorer='length'."
        )
    return info, None
