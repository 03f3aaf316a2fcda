"""Curriculum learning: train on the easiest data first and admit harder data as training goes on.

Papers: Bengio et al., "Curriculum Learning", ICML 2009 (doi:10.1145/1553374.1553380); Hacohen & Weinshall,
"On The Power of Curriculum Learning in Training Deep Networks", arXiv:1904.03626 (a *scoring function* orders
the data, a *pacing function* says how much of it is admitted); Platanios et al., "Competence-based Curriculum
Learning for Neural Machine Translation", arXiv:1903.09848 (the "root" pacing). Sequence-length warm-up: Li et
al., "The Stability-Efficiency Dilemma: Investigating Sequence Length Warmup for Training GPT Models",
arXiv:2108.06084, as MosaicML Composer's ``SeqLengthWarmup``.

Scoring. A scorer maps a sample to a number; a low score is easy. Built in: :class:`LengthScorer` (the number
of real tokens) and :class:`LossScorer` (the per-sample loss under a reference model: a teacher, or the model
itself before training, i.e. self-paced). :func:`compute_scores` scores a dataset once and can cache the
scores on disk, keyed by a hash of the data and one of the scorer, so a second run reads them back.

Pacing. With the ``N`` samples sorted by score, optimizer step ``t`` admits the easiest
``n_t = ceil(g(t) * N)`` samples, with ``s`` the start fraction and ``T`` the duration (all four give
``g(t) = 1`` for ``t >= T``). Ties are broken by a shuffle drawn from the seed, not by position: data sets are
often stored sorted by label or source, and a coarse score (lengths cut at ``max_length``) would otherwise
admit the first classes first::

    linear        g(t) = s + (1 - s) * t / T
    root          g(t) = sqrt(s^2 + (1 - s^2) * t / T)                  (Platanios et al.'s competence)
    step          g(t) = s + (1 - s) * floor(K * t / T) / K             (K = stairs equal rises)
    exponential   g(t) = s * (1 / s)^(t / T)

Sampling (:class:`CurriculumSampler`). Every epoch is a stream of draws: each draw is uniform among the
admitted samples not yet drawn in the current *pass*; a pass ends when every admitted sample was drawn, and
samples that are admitted mid-pass join the current pass at once (a Fisher-Yates shuffle whose range grows
with the pool). So each step draws only from its pool, and once the pool is the whole data set an epoch is a
permutation of it. An epoch keeps the length it has without a curriculum (``N`` samples, split over the
ranks), so step counting is unchanged; its stream depends only on ``(seed, epoch)`` and the schedule, which
makes the position resumable as just ``(epoch, batches done)``. Under DDP every rank computes the same stream
and rank ``r`` takes positions ``r, r + R, ...``: batch ``k`` of every rank comes from global batch ``k``
(``R * B`` draws at one step), so the shares are disjoint and together are what one process with batch size
``R * B`` draws.

Sequence-length warm-up (:func:`warmup_length`, :func:`truncate_batch`): at step ``t`` the batch's ``(B, T)``
tensors are cut to ``L(t)`` positions, ``L`` rising from ``min_length`` to ``max_length`` over ``duration``
steps in multiples of 8.

Shapes: scores ``(N,)`` float64; batches are dicts of ``(B, T)`` tensors (``input_ids``, ``attention_mask``,
...) plus per-sample ones such as ``labels`` ``(B,)``.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Sampler, default_collate

from lightning_peft._atomic import write_files
from lightning_peft.training.accumulation import AccumulationSchedule

__all__ = [
    "PACINGS", "CurriculumSampler", "LengthScorer", "LossScorer", "classification_loss", "compute_scores",
    "pacing_fraction", "truncate_batch", "warmup_length",
]

log = logging.getLogger(__name__)

PACINGS = ("linear", "root", "step", "exponential")
TRUNCATED_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels")


# ----------------------------------------------------------------------------------------------------- pacing


def pacing_fraction(
    step: int,
    pacing: str = "linear",
    start_fraction: float = 0.2,
    duration: int = 1000,
    stairs: int = 4,
    who: str = "pacing_fraction",
) -> float:
    """``g(step)``: the fraction of the sorted data admitted at optimizer step ``step``.

    Args:
        step: The optimizer step, counted from 0.
        pacing: ``"linear"``, ``"root"``, ``"step"`` or ``"exponential"`` (formulas in the module docstring).
        start_fraction: ``g(0)``, in ``(0, 1]``.
        duration: The step from which all the data is admitted (``g = 1``).
        stairs: Number of equal rises of the ``"step"`` pacing (ignored by the others).
        who: Name used in error messages.

    Returns:
        The fraction, in ``[start_fraction, 1]``.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or the pacing is unknown.

    Example:
        >>> [round(pacing_fraction(t, "linear", 0.2, 4), 2) for t in range(6)]
        [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
        >>> [round(pacing_fraction(t, "step", 0.2, 4, stairs=2), 2) for t in range(5)]
        [0.2, 0.2, 0.6, 0.6, 1.0]
    """
    check_pacing(pacing, start_fraction, duration, stairs, who)
    _check_int(who, "step", step, minimum=0)
    if step >= duration:
        return 1.0
    s, x = float(start_fraction), step / duration
    if pacing == "linear":
        return s + (1 - s) * x
    if pacing == "root":
        return math.sqrt(s * s + (1 - s * s) * x)
    if pacing == "step":
        return s + (1 - s) * ((stairs * step) // duration) / stairs
    return s ** (1 - x)  # exponential: s * (1 / s) ** x


def check_pacing(pacing: object, start_fraction: object, duration: object, stairs: object, who: str) -> None:
    """Raises what :func:`pacing_fraction` would raise for these settings; returns None if they are valid."""
    if pacing not in PACINGS:
        choices = ", ".join(repr(name) for name in PACINGS)
        raise ValueError(f"{who}(pacing={pacing!r}): unknown pacing; choose one of {choices}.")
    if isinstance(start_fraction, bool) or not isinstance(start_fraction, numbers.Real):
        raise TypeError(
            f"{who}(start_fraction={start_fraction!r}): start_fraction must be a number in (0, 1]."
        )
    if not 0 < start_fraction <= 1:
        raise ValueError(
            f"{who}(start_fraction={start_fraction!r}): start_fraction must be in (0, 1]: the share of the "
            "easiest data admitted at step 0 (1 admits everything from the start)."
        )
    _check_int(who, "duration", duration, minimum=1, meaning="the step from which all the data is admitted")
    _check_int(who, "stairs", stairs, minimum=1, meaning="the number of equal rises of the 'step' pacing")


def _check_int(who: str, name: str, value: object, minimum: int, meaning: str = "") -> None:
    """TypeError unless ``value`` is an int (not a bool); ValueError if it is below ``minimum``."""
    why = f" ({meaning})" if meaning else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{who}({name}={value!r}): {name} must be an integer >= {minimum}{why}.")
    if value < minimum:
        raise ValueError(f"{who}({name}={value!r}): {name} must be an integer >= {minimum}{why}.")


# ---------------------------------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class LengthScorer:
    """Scores a sample by its number of real tokens: short is easy.

    The length is ``sum(sample["attention_mask"])`` when the sample is a mapping with an attention mask, else
    the number of entries of ``sample[key]`` that are not ``pad_token_id`` (all of them when it is None).

    Args:
        key: Where the token ids are in a sample: a mapping key, or an index for tuple samples.
        pad_token_id: The padding id not to count; None counts every entry.

    Example:
        >>> LengthScorer()({"input_ids": [101, 7, 8, 102], "labels": 1})
        4.0
        >>> LengthScorer(key=0, pad_token_id=0)((torch.tensor([5, 6, 0, 0]), 1))
        2.0
    """

    key: str | int = "input_ids"
    pad_token_id: int | None = None

    def __call__(self, sample: Any) -> float:
        if isinstance(sample, Mapping) and "attention_mask" in sample and self.pad_token_id is None:
            return float(torch.as_tensor(sample["attention_mask"]).sum())
        try:
            ids = sample[self.key]
        except (KeyError, IndexError, TypeError):
            raise TypeError(
                f"LengthScorer(key={self.key!r}): a sample of type {type(sample).__name__} has no entry "
                f"{self.key!r}; set key to where the token ids are (a dict key, or 0 for (ids, label) "
                "tuples)."
            ) from None
        ids = torch.as_tensor(ids)
        return float(ids.numel() if self.pad_token_id is None else (ids != self.pad_token_id).sum())

    def fingerprint(self) -> str:
        """What the score cache keys this scorer by: its class and settings."""
        return f"{type(self).__module__}.{self!r}"


def classification_loss(model: nn.Module, batch: Any) -> Tensor:
    """Per-sample cross-entropy of a classifier, shape ``(B,)``: the default loss of :class:`LossScorer`.

    Args:
        model: Returns logits ``(B, C)``, or an object with ``.logits`` (a Hugging Face model).
        batch: A dict with ``labels`` ``(B,)`` whose other entries are the model's keyword arguments, or an
            ``(inputs, labels, ...)`` sequence.

    Raises:
        ValueError: If the logits are not ``(B, C)`` or the labels not ``(B,)``.
    """
    if isinstance(batch, Mapping):
        labels = batch["labels"]
        output = model(**{key: value for key, value in batch.items() if key != "labels"})
    else:
        output, labels = model(batch[0]), batch[1]
    logits = getattr(output, "logits", output)  # (B, C)
    if logits.ndim != 2 or labels.ndim != 1:
        raise ValueError(
            "LossScorer: the default loss takes logits (B, C) and labels (B,), got logits "
            f"{tuple(logits.shape)} and labels {tuple(labels.shape)}; pass loss_fn=f(model, batch) -> (B,) "
            "losses for other tasks (a language model's mean token loss per sample, for instance)."
        )
    return F.cross_entropy(logits.float(), labels, reduction="none")


class LossScorer:
    """Scores samples by their loss under a reference model: a teacher, or the untrained model (self-paced).

    The model runs in eval mode (every module's mode is put back afterwards) without gradients, on batches of
    ``batch_size`` samples collated by ``collate_fn`` and moved to the model's device.

    Args:
        model: The reference model.
        collate_fn: Makes a batch of a list of samples; None uses ``torch``'s ``default_collate``.
        batch_size: Samples per forward pass.
        loss_fn: ``loss_fn(model, batch) -> (B,)`` per-sample losses; None uses :func:`classification_loss`.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``batch_size`` is not positive.
    """

    def __init__(
        self,
        model: nn.Module,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        batch_size: int = 32,
        loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"LossScorer(model={type(model).__name__}): model must be a torch.nn.Module.")
        _check_int("LossScorer", "batch_size", batch_size, minimum=1)
        for name, value in (("collate_fn", collate_fn), ("loss_fn", loss_fn)):
            if value is not None and not callable(value):
                raise TypeError(f"LossScorer({name}={value!r}): {name} must be callable or None.")
        self.model = model
        self.collate_fn = collate_fn or default_collate
        self.batch_size = batch_size
        self.loss_fn = loss_fn or classification_loss

    @torch.no_grad()
    def score_batch(self, samples: list[Any]) -> Tensor:
        """The losses of ``samples``, shape ``(len(samples),)``."""
        device = next(self.model.parameters(), torch.empty(0)).device
        batch = _to_device(self.collate_fn(samples), device)
        modes = {module: module.training for module in self.model.modules()}
        self.model.eval()
        try:
            return self.loss_fn(self.model, batch).detach().float().cpu()
        finally:
            for module, training in modes.items():
                module.training = training

    def __call__(self, sample: Any) -> float:
        return float(self.score_batch([sample])[0])

    def fingerprint(self) -> str:
        """What the score cache keys this scorer by: the model's class and weights, and the loss function."""
        digest = hashlib.blake2b(digest_size=16)
        for name, tensor in sorted(self.model.state_dict().items()):
            digest.update(name.encode())
            _feed_tensor(digest, tensor)
        return (f"LossScorer(model={type(self.model).__qualname__}:{digest.hexdigest()}, "
                f"loss_fn={_fingerprint(self.loss_fn)}, collate_fn={_fingerprint(self.collate_fn)}, "
                f"batch_size={self.batch_size})")


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {key: _to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(value, device) for value in batch)
    return batch


def compute_scores(
    dataset: Sequence[Any],
    scorer: Callable[[Any], float],
    cache_dir: str | Path | None = None,
    data_fingerprint: str | None = None,
) -> Tensor:
    """Scores every sample of ``dataset`` (low = easy), reading and writing an on-disk cache if asked to.

    A scorer is a callable ``sample -> number``. One with a ``score_batch(samples) -> (B,)`` method and a
    ``batch_size`` (as :class:`LossScorer`) is called on batches instead. The cache file,
    ``cache_dir/scores-<key>.pt``, is keyed by a hash of the data (every sample's content; or
    ``data_fingerprint``) and one of the scorer: its ``fingerprint()`` method (or string attribute) if it has
    one, else, for a plain function or a ``functools.partial`` of one, its qualified name, bytecode and bound
    arguments. It is written under a temporary name and renamed into place, so a crash leaves no half-written
    file.

    Args:
        dataset: A map-style dataset (``len`` and ``[i]``).
        scorer: The scoring function.
        cache_dir: Folder of the score cache; None scores without caching.
        data_fingerprint: Stands for the data in the cache key instead of hashing every sample (for large data
            sets: a version string, for instance).

    Returns:
        The scores, shape ``(N,)`` float64.

    Raises:
        ValueError: If the dataset is empty, a score is not finite, or ``score_batch`` miscounts.
        TypeError: If a score is not a number, or a scorer cannot be fingerprinted for the cache.
    """
    count = len(dataset)
    name = _name(scorer)
    if count == 0:
        raise ValueError(f"compute_scores: the dataset is empty, so there is nothing for {name} to score.")
    path = key = None
    if cache_dir is not None:
        key = {"data": data_fingerprint or dataset_fingerprint(dataset), "scorer": _fingerprint(scorer)}
        digest = hashlib.sha256(f"{key['data']}\n{key['scorer']}".encode()).hexdigest()[:32]
        path = Path(cache_dir) / f"scores-{digest}.pt"
        cached = _read_cache(path, key, count)
        if cached is not None:
            log.info("compute_scores: read the %d scores of %s from %s.", count, name, path)
            return cached
    scores = _score_all(dataset, scorer, name)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {**key, "scores": scores}
        write_files({path: lambda tmp: torch.save(entry, tmp)})
        log.info("compute_scores: scored %d samples with %s; cached in %s.", count, name, path)
    return scores


def _score_all(dataset: Sequence[Any], scorer: Callable[[Any], float], name: str) -> Tensor:
    count = len(dataset)
    score_batch = getattr(scorer, "score_batch", None)
    values: list[Any] = []
    if callable(score_batch):
        size = getattr(scorer, "batch_size", 32)
        for start in range(0, count, size):
            samples = [dataset[i] for i in range(start, min(start + size, count))]
            got = score_batch(samples)
            if len(got) != len(samples):
                raise ValueError(
                    f"compute_scores: {name}.score_batch returned {len(got)} scores for {len(samples)} "
                    "samples; it must return one score per sample."
                )
            values.extend(got)
    else:
        values = [scorer(dataset[i]) for i in range(count)]
    scores = torch.empty(count, dtype=torch.float64)
    for index, value in enumerate(values):
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"compute_scores: {name} returned a {type(value).__name__} for sample {index}; a scorer must "
                "return a number (an int, a float or a one-element tensor)."
            )
        if not math.isfinite(value):
            raise ValueError(
                f"compute_scores: {name} gave {value} for sample {index}; scores must be finite. Fix the "
                "scorer or the sample (an empty sample, or a loss that overflowed, gives nan or inf)."
            )
        scores[index] = float(value)
    return scores


def _read_cache(path: Path, key: dict[str, str], count: int) -> Tensor | None:
    """The cached scores if ``path`` holds them for ``key`` and ``count`` samples, else None."""
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, weights_only=True)
    except Exception as error:  # unreadable: score again and overwrite
        log.warning("compute_scores: could not read the score cache %s (%s); scoring again.", path, error)
        return None
    scores = entry.get("scores") if isinstance(entry, dict) else None
    same_key = isinstance(entry, dict) and all(entry.get(k) == v for k, v in key.items())
    if not same_key or not isinstance(scores, Tensor) or scores.shape != (count,):
        return None
    return scores.to(torch.float64)


def dataset_fingerprint(dataset: Sequence[Any]) -> str:
    """A hash of every sample's content (mappings, sequences, tensors, arrays, strings and numbers).

    Raises:
        TypeError: If a sample holds a value of another type.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str(len(dataset)).encode())
    for index in range(len(dataset)):
        _feed(digest, dataset[index], index)
    return digest.hexdigest()


def _feed(digest: Any, value: Any, index: int) -> None:
    if isinstance(value, Tensor):
        _feed_tensor(digest, value)
    elif isinstance(value, Mapping):
        digest.update(b"{%d" % len(value))
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, value[key], index)
    elif isinstance(value, (list, tuple)):
        digest.update(b"[%d" % len(value))
        for item in value:
            _feed(digest, item, index)
    elif value is None or isinstance(value, (str, bytes, numbers.Number)):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
    elif all(hasattr(value, attr) for attr in ("tobytes", "dtype", "shape")):  # a numpy array
        digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
        digest.update(value.tobytes())
    else:
        raise TypeError(
            f"compute_scores: sample {index} holds a {type(value).__name__}, which the score cache cannot "
            "hash; pass compute_scores(..., data_fingerprint='<a name for this data>'), or cache_dir=None."
        )


def _feed_tensor(digest: Any, tensor: Tensor) -> None:
    tensor = tensor.detach().cpu().contiguous()
    digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def _fingerprint(scorer: Any) -> str:
    """The scorer's part of the cache key (see :func:`compute_scores`)."""
    own = getattr(scorer, "fingerprint", None)
    if callable(own):
        return str(own())
    if isinstance(own, str):
        return own
    if isinstance(scorer, functools.partial):
        keywords = sorted(scorer.keywords.items())
        return f"partial({_fingerprint(scorer.func)}, args={scorer.args!r}, keywords={keywords!r})"
    if inspect.ismethod(scorer):  # what the method reads of its object is keyed too
        return f"{_fingerprint(scorer.__func__)}:self={_object_key(scorer.__self__)}"
    code = getattr(scorer, "__code__", None)
    if isinstance(code, CodeType):
        digest = hashlib.blake2b(digest_size=16)
        _feed_code(digest, code)
        defaults = (getattr(scorer, "__defaults__", None), sorted((getattr(scorer, "__kwdefaults__", None) or {}).items()))
        # What the code reads besides its arguments: closure cells and the module globals it names. Plain data is
        # keyed by value (a threshold captured by a closure, a MAX_LEN constant); anything else by its type only.
        cells = [_data_key(cell.cell_contents) for cell in (getattr(scorer, "__closure__", None) or ())
                 if _cell_is_set(cell)]
        names = _code_names(code)
        module_globals = getattr(scorer, "__globals__", {})
        reads = sorted((name, _data_key(module_globals[name])) for name in names if name in module_globals)
        digest.update(repr((cells, reads)).encode())
        return f"{scorer.__module__}.{scorer.__qualname__}:{digest.hexdigest()}:{defaults!r}"
    raise TypeError(
        f"compute_scores: cannot key the score cache by {_name(scorer)}, a {type(scorer).__name__} without a "
        "fingerprint; give it a fingerprint() method returning a string that changes when its scores would, "
        "use a plain function, or pass cache_dir=None."
    )


def _object_key(value: Any) -> str:
    """A key of an object's state, for the object a scoring method is bound to: its own ``fingerprint()`` if it
    has one; tensors and modules by content; plain data by value; other objects by their attributes.

    Raises:
        TypeError: For state that cannot be keyed (an object without ``__dict__`` nor a fingerprint).
    """
    own = getattr(value, "fingerprint", None)
    if callable(own):
        return str(own())
    if isinstance(value, Tensor):
        digest = hashlib.blake2b(digest_size=16)
        _feed_tensor(digest, value)
        return f"tensor:{digest.hexdigest()}"
    if isinstance(value, nn.Module):
        return f"{type(value).__qualname__}({_object_key(dict(value.state_dict()))}, training={value.training})"
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return repr(value)
    if isinstance(value, tuple | list):
        return f"{type(value).__name__}({[_object_key(v) for v in value]})"
    if isinstance(value, Mapping):
        return f"dict({sorted((repr(k), _object_key(v)) for k, v in value.items())})"
    if callable(value) and hasattr(value, "__code__"):
        return _fingerprint(value)
    state = getattr(value, "__dict__", None)
    if state is None:
        raise TypeError(
            f"compute_scores: cannot key the score cache by the state of a {type(value).__qualname__} (a scoring "
            "method's object); give its class a fingerprint() method returning a string that changes when its "
            "scores would, or pass cache_dir=None."
        )
    return f"{type(value).__module__}.{type(value).__qualname__}({_object_key(dict(state))})"


def _data_key(value: Any) -> str:
    """``repr`` for plain data (numbers, strings, bytes, None, and tuples, lists, sets and dicts of them); the type
    for anything else (a module, a function, an object), whose state cannot be keyed reliably."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return repr(value)
    if isinstance(value, tuple | list | frozenset | set):
        items = [_data_key(v) for v in value]
        return f"{type(value).__name__}({sorted(items) if isinstance(value, frozenset | set) else items})"
    if isinstance(value, dict):
        return f"dict({sorted((_data_key(k), _data_key(v)) for k, v in value.items())})"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _cell_is_set(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


def _code_names(code: CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _code_names(const)
    return names


def _feed_code(digest: Any, code: CodeType) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, CodeType):
            _feed_code(digest, const)
        else:
            digest.update(repr(const).encode())


def _name(scorer: Any) -> str:
    if isinstance(scorer, LengthScorer):
        return repr(scorer)
    return getattr(scorer, "__qualname__", None) or type(scorer).__qualname__


# ---------------------------------------------------------------------------------------------------- sampler


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"curriculum,{seed},{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class CurriculumSampler(Sampler[int]):
    """Draws each batch from the easiest ``ceil(g(t) * N)`` samples (``g`` the pacing, ``t`` the step).

    See the module docstring for the draw rule. Use it as a DataLoader's ``sampler`` with the same
    ``batch_size``; under DDP give every rank the same arguments but its own ``rank`` (the data-parallel rank:
    under pipeline or tensor parallelism the ranks that read one batch share it). The step of batch ``k`` of
    epoch ``e`` is the optimizer step a trainer reaches there: windows of ``accumulate_grad_batches``
    micro-batches (a count, or a step-keyed :class:`~lightning_peft.training.AccumulationSchedule`) are laid from
    each epoch's first batch, one optimizer step each, and a trainer steps at the end of an epoch even inside a
    window; for a constant count ``a`` that is ``e * ceil(batches_per_epoch / a) + k // a``.

    Resuming: ``state_dict()`` is ``{"epoch", "batches", "step", "epoch_step"}`` (batches of that epoch handed
    out, counted when a batch's first index is; the optimizer step there and at the epoch's start), and
    ``load_state_dict`` makes the next iteration go on from there, pacing from that *step*: a run resumed with
    another accumulation count, number of ranks or ``limit_train_batches`` keeps pacing by the optimizer step
    it is really at. DataLoader workers fetch ahead of training; then save ``{"epoch": e, "batches": <batches
    trained in epoch e>, "step": <optimizer steps done>}`` yourself (the ``Curriculum`` callback takes them from
    the trainer).

    Args:
        scores: One score per sample, shape ``(N,)``; low is easy; ties are broken by a shuffle drawn
            from ``seed``.
        batch_size: The DataLoader's batch size (per rank).
        duration: The pacing's ``T``: the step from which all the data is admitted.
        pacing: ``"linear"``, ``"root"``, ``"step"`` or ``"exponential"``.
        start_fraction: The share of the easiest data admitted at step 0, in ``(0, 1]``.
        stairs: Number of equal rises of the ``"step"`` pacing.
        seed: Seed of the draws; every epoch's draws depend only on ``(seed, epoch)`` and the schedule.
        num_replicas: Number of DDP ranks ``R``.
        rank: This process's rank, in ``[0, R)``.
        drop_last: Drop the samples that would make an incomplete last batch (set it as the DataLoader's).
            Else every rank gets ``ceil(N / R)`` samples (the extra ones drawn like the others).
        accumulate_grad_batches: Batches per optimizer step (a count or a step-keyed schedule): the pool changes
            only between optimizer steps.
        batches_per_epoch: Batches actually trained per epoch when a trainer cuts epochs short
            (``limit_train_batches``); None: all of them.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range, or a score is not finite.

    Example:
        Sample 3 is the easiest, then 1, 2, 0 (``order``). Step 0 admits two samples, step 1 three:

        >>> sampler = CurriculumSampler([3.0, 1.0, 2.0, 0.0], batch_size=2, duration=2, start_fraction=0.5)
        >>> sampler.order, [sampler.pool_size(t) for t in range(3)]
        ([3, 1, 2, 0], [2, 3, 4])
        >>> draws = list(sampler); sorted(draws[:2]), set(draws[2:]) <= {3, 1, 2}
        ([1, 3], True)
    """

    def __init__(
        self,
        scores: Sequence[float] | Tensor,
        batch_size: int,
        duration: int,
        pacing: str = "linear",
        start_fraction: float = 0.2,
        stairs: int = 4,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        accumulate_grad_batches: int | AccumulationSchedule = 1,
        batches_per_epoch: int | None = None,
    ) -> None:
        who = "CurriculumSampler"
        accumulation = (accumulate_grad_batches if isinstance(accumulate_grad_batches, AccumulationSchedule)
                        else None)
        check_pacing(pacing, start_fraction, duration, stairs, who)
        scores = torch.as_tensor(scores, dtype=torch.float64).detach().cpu()
        if scores.ndim != 1 or scores.numel() == 0:
            raise ValueError(
                f"{who}(scores of shape {tuple(scores.shape)}): scores must be a non-empty (N,) vector."
            )
        if not torch.isfinite(scores).all():
            index = int((~torch.isfinite(scores)).nonzero()[0])
            raise ValueError(
                f"{who}: score {index} is {scores[index].item()}; scores must be finite (compute_scores "
                "checks this)."
            )
        for name, value, minimum in (("batch_size", batch_size, 1), ("seed", seed, 0),
                                     ("num_replicas", num_replicas, 1), ("rank", rank, 0)):
            _check_int(who, name, value, minimum)
        if accumulation is None:
            _check_int(who, "accumulate_grad_batches", accumulate_grad_batches, minimum=1)
        if rank >= num_replicas:
            raise ValueError(
                f"{who}(rank={rank}, num_replicas={num_replicas}): rank must be in [0, num_replicas)."
            )
        size = scores.numel()
        if drop_last:
            per_rank = (size // num_replicas) // batch_size * batch_size
        else:
            per_rank = -(-size // num_replicas)  # ceil
        if per_rank == 0:
            raise ValueError(
                f"{who}(drop_last=True): {size} samples over {num_replicas} rank(s) do not fill one batch of "
                f"{batch_size}; lower batch_size or set drop_last=False."
            )
        full_batches = -(-per_rank // batch_size)
        if batches_per_epoch is not None:
            _check_int(who, "batches_per_epoch", batches_per_epoch, minimum=1)
            if batches_per_epoch > full_batches:
                raise ValueError(
                    f"{who}(batches_per_epoch={batches_per_epoch}): an epoch has only {full_batches} batches "
                    "here; pass at most that, or None."
                )
        ties = torch.Generator().manual_seed(_epoch_seed(seed, -1))
        shuffle = torch.randperm(scores.numel(), generator=ties)
        self.order: list[int] = shuffle[torch.argsort(scores[shuffle], stable=True)].tolist()  # easiest first
        self.scores = scores
        self.batch_size, self.duration, self.pacing = batch_size, duration, pacing
        self.start_fraction, self.stairs, self.seed = start_fraction, stairs, seed
        self.num_replicas, self.rank, self.drop_last = num_replicas, rank, drop_last
        self.accumulation = accumulation or AccumulationSchedule(accumulate_grad_batches, who=who)
        self.accumulate_grad_batches = self.accumulation.min_count if self.accumulation.is_constant else None
        self.num_samples = per_rank
        self.full_batches = full_batches
        self.batches_per_epoch = batches_per_epoch or full_batches
        self.epoch = 0
        self._start = 0  # the batch the next iteration of self.epoch begins with
        self._delivered = 0  # batches of self.epoch handed out so far
        # (epoch, batch, step, epoch_step): batch `batch` of `epoch` starts a window that produces optimizer step
        # `step`, and the epoch's first batch produced `epoch_step`. Steps are walked from here.
        self._anchor = (0, 0, 0, 0)
        self._steps: tuple[int, list[int]] | None = None  # (epoch, the step of each of its batches)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of a whole epoch (from step 0 for a changing schedule)."""
        return self.accumulation.steps_in_epochs(self.batches_per_epoch, 1)

    def step(self, epoch: int, batch: int) -> int:
        """The optimizer step at batch ``batch`` of epoch ``epoch`` (at or after the loaded position's epoch)."""
        return self._epoch_steps(epoch)[batch]

    def _epoch_steps(self, epoch: int) -> list[int]:
        """The optimizer step of every batch of epoch ``epoch``, shape ``(full_batches,)``."""
        if self._steps is not None and self._steps[0] == epoch:
            return self._steps[1]
        anchor_epoch, first, step, epoch_step = self._anchor
        if epoch < anchor_epoch:
            raise ValueError(
                f"CurriculumSampler.step(epoch={epoch}): the sampler continues from epoch {anchor_epoch}; earlier "
                "epochs are not paced any more."
            )
        if epoch > anchor_epoch:
            if first < self.batches_per_epoch:  # the rest of the anchor's epoch
                step += self.accumulation.steps_in_epochs(self.batches_per_epoch - first, 1, step)
            step += self.accumulation.steps_in_epochs(self.batches_per_epoch, epoch - anchor_epoch - 1, step)
            first, epoch_step = 0, step
        # Batches before the anchor (replayed, not trained) as the run that wrote it laid them; the rest from it.
        steps = _window_steps(self.accumulation, first, epoch_step)
        steps += _window_steps(self.accumulation, self.full_batches - first, step)
        self._steps = (epoch, steps)
        return steps

    def pool_size(self, step: int) -> int:
        """How many of the easiest samples step ``step`` draws from: ``ceil(g(step) * N)``, at least 1."""
        fraction = pacing_fraction(step, self.pacing, self.start_fraction, self.duration, self.stairs)
        size = len(self.order)
        return min(size, max(1, math.ceil(fraction * size - 1e-9)))

    @property
    def admitted_fraction(self) -> float:
        """The admitted share of the data at the latest batch handed out (or at the start position)."""
        return self.pool_size(self.step(self.epoch, max(self._delivered - 1, self._start))) / len(self.order)

    def set_epoch(self, epoch: int) -> None:
        """Selects epoch ``epoch``; a position loaded for that epoch is kept (trainers set it on resume).

        Raises:
            TypeError: If ``epoch`` is not an integer.
            ValueError: If ``epoch`` is negative.
        """
        _check_int("CurriculumSampler.set_epoch", "epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self.epoch, self._start, self._delivered = epoch, 0, 0

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "batches": k, "step": t, "epoch_step": t0}``: ``k`` batches of epoch ``e`` were handed
        out; the next one is paced at optimizer step ``t``, and the epoch's first one was at ``t0``."""
        return {"epoch": self.epoch, "batches": self._delivered, "step": self._step_after(self.epoch, self._delivered),
                "epoch_step": self.step(self.epoch, 0)}

    def _step_after(self, epoch: int, batches: int) -> int:
        """The optimizer step of the batch after ``batches`` batches of ``epoch`` (the next epoch's first)."""
        if batches < self.batches_per_epoch:
            return self.step(epoch, batches)
        return self.step(epoch, 0) + self.accumulation.steps_in_epochs(self.batches_per_epoch, 1, self.step(epoch, 0))

    def load_state_dict(self, state_dict: Mapping[str, int]) -> None:
        """Continue after batch ``batches`` of epoch ``epoch`` (at the next epoch if that one is complete).

        Raises:
            TypeError: If a value is not an integer.
            ValueError: If a key is missing or a value is out of range.
        """
        who = "CurriculumSampler.load_state_dict"
        if not isinstance(state_dict, Mapping) or {"epoch", "batches"} - set(state_dict):
            raise ValueError(
                f"{who}({state_dict!r}): expected a dict with 'epoch' and 'batches' (from state_dict())."
            )
        epoch, batches = state_dict["epoch"], state_dict["batches"]
        _check_int(who, "epoch", epoch, minimum=0)
        _check_int(who, "batches", batches, minimum=0)
        if batches > self.batches_per_epoch:
            raise ValueError(
                f"{who}(batches={batches}): an epoch has {self.batches_per_epoch} batches here; was the "
                "state saved with another batch size, data set or number of ranks?"
            )
        # An older state without steps: the steps this sampler's own settings give there.
        self._anchor, self._steps = (0, 0, 0, 0), None
        step = state_dict.get("step", self._step_after(epoch, batches))
        epoch_step = state_dict.get("epoch_step", self.step(epoch, 0))
        _check_int(who, "step", step, minimum=0)
        _check_int(who, "epoch_step", epoch_step, minimum=0)
        if batches == self.batches_per_epoch:
            epoch, batches, epoch_step = epoch + 1, 0, step
        self._anchor, self._steps = (epoch, batches, step, epoch_step), None
        self.epoch, self._start, self._delivered = epoch, batches, batches

    def __iter__(self) -> Iterator[int]:
        epoch, start = self.epoch, self._start
        self._start, self._delivered = 0, start
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        replicas = self.num_replicas
        swaps: dict[int, int] = {}  # Fisher-Yates over positions of self.order; only moved ones are stored
        drawn = 0  # draws so far in the current pass
        steps = self._epoch_steps(epoch)
        for batch in range(self.full_batches):
            size = min(self.batch_size, self.num_samples - batch * self.batch_size)  # the same on every rank
            pool = self.pool_size(steps[batch])
            uniforms = torch.rand(replicas * size, generator=generator, dtype=torch.float64)  # (R * b,)
            picks = []
            for uniform in uniforms.tolist():
                position = drawn + min(int(uniform * (pool - drawn)), pool - drawn - 1)
                picks.append(swaps.get(position, position))
                swaps[position] = swaps.get(drawn, drawn)
                drawn += 1
                if drawn == pool:  # every admitted sample was drawn: a new pass
                    drawn = 0
                    swaps.clear()
            if batch < start:
                continue
            self._delivered = batch + 1
            for pick in picks[self.rank :: replicas]:
                yield self.order[pick]


def _window_steps(accumulation: AccumulationSchedule, batches: int, step: int) -> list[int]:
    """The optimizer step of each of ``batches`` micro-batches laid in windows from ``step``."""
    if batches == 0:
        return []
    sizes = accumulation.windows(batches, step)
    return [step + index for index, size in enumerate(sizes) for _ in range(size)]


# ------------------------------------------------------------------------------------ sequence-length warm-up


def warmup_length(
    step: int, min_length: int, max_length: int, duration: int, multiple: int = 8, who: str = "warmup_length"
) -> int:
    """The sequence length at step ``step``: ``min_length`` rising by ``multiple`` to ``max_length``.

    ``L(t) = min(max_length, min_length + multiple * floor((max_length - min_length) * t / (multiple * T)))``
    for ``t < T = duration``, and ``max_length`` from ``T`` on.

    Raises:
        TypeError: If an argument is not an integer.
        ValueError: If an argument is out of range, or ``min_length > max_length``.

    Example:
        >>> [warmup_length(t, 8, 32, 4) for t in range(5)]
        [8, 8, 16, 24, 32]
    """
    _check_int(who, "step", step, minimum=0)
    _check_int(who, "min_length", min_length, minimum=1)
    _check_int(who, "max_length", max_length, minimum=1)
    _check_int(who, "duration", duration, minimum=1)
    _check_int(who, "multiple", multiple, minimum=1)
    if min_length > max_length:
        raise ValueError(
            f"{who}(min_length={min_length}, max_length={max_length}): min_length must be <= max_length."
        )
    if step >= duration:
        return max_length
    rises = ((max_length - min_length) * step) // (multiple * duration)
    return min(max_length, min_length + multiple * rises)


def truncate_batch(
    batch: Mapping[str, Any], length: int, keys: Sequence[str] = TRUNCATED_KEYS
) -> dict[str, Any]:
    """A copy of ``batch`` whose ``(B, T)`` tensors keep their first ``length`` positions.

    The tensors cut are those named in ``keys`` with at least 2 dimensions and ``T`` (the length of
    ``input_ids``) positions on dimension 1: ``labels`` of shape ``(B,)`` stays whole, token labels ``(B, T)``
    are cut. Plain truncation, as Composer's ``SeqLengthWarmup`` does by default: the end of a longer sequence
    (its ``[SEP]`` or end-of-sequence token) is dropped. Assumes right padding: with left padding the first
    positions are padding. The tensors are views of the originals; ``batch`` itself is not changed.

    Raises:
        TypeError: If ``batch`` is not a mapping.
        ValueError: If it has no ``input_ids`` tensor of shape ``(B, T)``, or ``length`` is not positive.

    Example:
        >>> batch = {"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.tensor([0, 1])}
        >>> {k: tuple(v.shape) for k, v in truncate_batch(batch, 3).items()}
        {'input_ids': (2, 3), 'labels': (2,)}
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"truncate_batch: the batch is a {type(batch).__name__}; it must be a dict of (B, T) tensors "
            "such as input_ids and attention_mask (what a Hugging Face tokenizer and collator give)."
        )
    _check_int("truncate_batch", "length", length, minimum=1)
    ids = batch.get("input_ids")
    if not isinstance(ids, Tensor) or ids.ndim < 2:
        raise ValueError(
            "truncate_batch: the batch needs an input_ids tensor of shape (B, T); its keys are "
            f"{sorted(batch)}."
        )
    full = ids.shape[1]
    return {
        key: value[:, :length]
        if key in keys and isinstance(value, Tensor) and value.ndim >= 2 and value.shape[1] == full
        else value
        for key, value in batch.items()
    }
