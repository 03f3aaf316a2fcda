"""The curriculum sampler: each batch is drawn from the easiest ``ceil(g(t) * N)`` samples at optimizer step ``t``.

Paper: Hacohen & Weinshall, arXiv:1904.03626 (``g`` the pacing: `lightning_peft.training.pacing`).

Every epoch is a stream of draws: each draw is uniform among the admitted samples not yet drawn in the current
*pass*; a pass ends when every admitted sample was drawn, and samples that are admitted mid-pass join the current
pass at once (a Fisher-Yates shuffle whose range grows with the pool). So each step draws only from its pool, and
once the pool is the whole data set an epoch is a permutation of it. Ties are broken by a shuffle drawn from the
seed, not by position: data sets are often stored sorted by label or source, and a coarse score (lengths cut at
``max_length``) would otherwise admit the first classes first.

An epoch keeps the length it has without a curriculum (``N`` samples, split over the ranks), so step counting is
unchanged; its stream depends only on ``(seed, epoch)`` and the schedule, which makes the position resumable as just
``(epoch, batches done)``. Under DDP every rank computes the same stream and rank ``r`` takes positions
``r, r + R, ...``: batch ``k`` of every rank comes from global batch ``k`` (``R * B`` draws at one step), so the
shares are disjoint and together are what one process with batch size ``R * B`` draws.

Shapes: scores ``(N,)`` float64; the sampler yields sample indices.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor
from torch.utils.data import Sampler

from lightning_peft._checks import integer
from lightning_peft.training.accumulation import AccumulationSchedule
from lightning_peft.training.pacing import check_pacing, pacing_fraction

__all__ = ["CurriculumSampler"]


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"curriculum,{seed},{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class CurriculumSampler(Sampler[int]):
    """Draws each batch from the easiest ``ceil(g(t) * N)`` samples (``g`` the pacing, ``t`` the step).

    See the module docstring for the draw rule. Use it as a DataLoader's ``sampler`` with the same ``batch_size``; under
    DDP give every rank the same arguments but its own ``rank`` (the data-parallel rank: under pipeline or tensor
    parallelism the ranks that read one batch share it). The step of batch ``k`` of epoch ``e`` is the optimizer step a
    trainer reaches there: windows of ``accumulate_grad_batches`` micro-batches (a count, or a step-keyed
    [`AccumulationSchedule`][lightning_peft.training.AccumulationSchedule]) are laid from each epoch's first batch, one
    optimizer step each, and a trainer steps at the end of an epoch even inside a window; for a constant count ``a``
    that is ``e * ceil(batches_per_epoch / a) + k // a``.

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

    Examples:
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
            integer(who, name, value, minimum=minimum)
        if accumulation is None:
            integer(who, "accumulate_grad_batches", accumulate_grad_batches, minimum=1)
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
            integer(who, "batches_per_epoch", batches_per_epoch, minimum=1)
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

    def fraction(self, step: int) -> float:
        """The admitted share of the data at optimizer step ``step``."""
        return self.pool_size(step) / len(self.order)

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
        integer("CurriculumSampler.set_epoch", "epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self.epoch, self._start, self._delivered = epoch, 0, 0

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "batches": k, "step": t, "epoch_step": t0}``: ``k`` batches of epoch ``e`` were handed
        out; the next one is paced at optimizer step ``t``, and the epoch's first one was at ``t0``."""
        return {"epoch": self.epoch, "batches": self._delivered, "step": self._step_after(self.epoch, self._delivered),
                "epoch_step": self.step(self.epoch, 0)}

    def position(self, batches: int, step: int) -> dict[str, int]:
        """[`state_dict`][lightning_peft.training.CurriculumSampler.state_dict] as a trainer counts it: ``batches`` of
        the current epoch trained, ``step`` optimizer steps done (DataLoader workers fetch ahead of training, so the
        sampler's own count runs ahead)."""
        return {"epoch": self.epoch, "batches": min(batches, self.batches_per_epoch), "step": step,
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
        integer(who, "epoch", epoch, minimum=0)
        integer(who, "batches", batches, minimum=0)
        if batches > self.batches_per_epoch:
            raise ValueError(
                f"{who}(batches={batches}): an epoch has {self.batches_per_epoch} batches here; was the "
                "state saved with another batch size, data set or number of ranks?"
            )
        # An older state without steps: the steps this sampler's own settings give there.
        self._anchor, self._steps = (0, 0, 0, 0), None
        step = state_dict.get("step", self._step_after(epoch, batches))
        epoch_step = state_dict.get("epoch_step", self.step(epoch, 0))
        integer(who, "step", step, minimum=0)
        integer(who, "epoch_step", epoch_step, minimum=0)
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
