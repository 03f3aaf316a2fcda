"""Curriculum learning in pure PyTorch: pacing against hand-computed values, the sampler's pools, passes, DDP
shares and resume, the score cache, the loss scorer, and the sequence-length warm-up."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_peft.training import AccumulationSchedule, curriculum, score_cache
from lightning_peft.training.curriculum import (
    CurriculumSampler,
    LengthScorer,
    LossScorer,
    check_ordered,
    classification_loss,
    compute_scores,
    pacing_fraction,
    truncate_batch,
    warmup_length,
)

# ------------------------------------------------------------------------------------------------ pacing

S, T = 0.2, 8  # start fraction, duration
EXPECTED = {
    "linear": {0: 0.2, 2: 0.4, 4: 0.6, 6: 0.8, 7: 0.9},
    "root": {0: 0.2, 2: math.sqrt(0.04 + 0.96 * 2 / 8), 4: math.sqrt(0.52),
             6: math.sqrt(0.04 + 0.96 * 6 / 8)},
    "step": {0: 0.2, 1: 0.2, 2: 0.4, 3: 0.4, 4: 0.6, 5: 0.6, 6: 0.8, 7: 0.8},  # 4 stairs of 2 steps
    "exponential": {0: 0.2, 2: 0.2 * 5**0.25, 4: 0.2 * 5**0.5, 6: 0.2 * 5**0.75},
}


@pytest.mark.parametrize("pacing", sorted(EXPECTED))
def test_pacing_functions_give_the_hand_computed_fractions_and_1_from_the_duration_on(pacing):
    for step, fraction in EXPECTED[pacing].items():
        assert pacing_fraction(step, pacing, S, T, stairs=4) == pytest.approx(fraction, rel=1e-12), step
    assert pacing_fraction(T, pacing, S, T) == 1.0 and pacing_fraction(10 * T, pacing, S, T) == 1.0
    values = [pacing_fraction(t, pacing, S, 100, stairs=3) for t in range(120)]
    assert values == sorted(values) and values[0] == pytest.approx(S)  # never shrinks


def test_start_fraction_1_admits_everything_at_once():
    assert all(pacing_fraction(t, name, 1.0, 5) == 1.0 for name in curriculum.PACINGS for t in range(6))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"pacing": "cosine"}, ValueError,
     (r"pacing_fraction\(pacing='cosine'\): pacing must be one of 'linear', 'root', 'step', "
      r"'exponential'\.")),
    ({"start_fraction": 0.0}, ValueError,
     r"pacing_fraction\(start_fraction=0\.0\): start_fraction must be a finite number in \(0, 1\] \(the share of "),
    ({"start_fraction": 1.5}, ValueError,
     r"pacing_fraction\(start_fraction=1\.5\): start_fraction must be a finite number in \(0, 1\]"),
    ({"start_fraction": "0.5"}, TypeError,
     r"pacing_fraction\(start_fraction='0\.5'\): start_fraction must be a finite number"),
    ({"duration": 0}, ValueError,
     (r"pacing_fraction\(duration=0\): duration must be an integer >= 1 \(the step from which all the data "
      r"is admitted\)")),
    ({"duration": 2.5}, TypeError, r"pacing_fraction\(duration=2\.5\): duration must be an integer >= 1"),
    ({"stairs": 0}, ValueError,
     (r"pacing_fraction\(stairs=0\): stairs must be an integer >= 1 \(the number of equal rises of the "
      r"'step' pacing\)")),
    ({"step": -1}, ValueError, r"pacing_fraction\(step=-1\): step must be an integer >= 0"),
    ({"step": True}, TypeError, r"pacing_fraction\(step=True\): step must be an integer >= 0"),
])
def test_bad_pacing_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        pacing_fraction(**{"step": 0, "pacing": "linear", "start_fraction": 0.2, "duration": 10, **kwargs})


# ----------------------------------------------------------------------------------------------- sampler


def shuffled_scores(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).double()


def batches(sampler: CurriculumSampler) -> list[list[int]]:
    draws = list(sampler)
    return [draws[i : i + sampler.batch_size] for i in range(0, len(draws), sampler.batch_size)]


@pytest.mark.parametrize("pacing", ["linear", "root", "step", "exponential"])
def test_every_batch_comes_from_its_steps_pool_and_the_pool_follows_the_pacing(pacing):
    scores = shuffled_scores(40)
    sampler = CurriculumSampler(scores, batch_size=4, duration=10, pacing=pacing, start_fraction=0.1,
                                stairs=2)
    order = torch.argsort(scores).tolist()
    assert sampler.order == order  # no ties here
    for epoch in range(2):  # 10 batches an epoch: epoch 0 paces, epoch 1 has everything
        sampler.set_epoch(epoch)
        for k, batch in enumerate(batches(sampler)):
            step = 10 * epoch + k
            size = sampler.pool_size(step)
            assert size == min(40, math.ceil(round(pacing_fraction(step, pacing, 0.1, 10, 2) * 40, 9)))
            assert set(batch) <= set(order[:size]), (step, batch)
    sampler.set_epoch(0)
    ranks = {order.index(i) for batch in batches(sampler) for i in batch}
    assert max(ranks) >= sampler.pool_size(0) == 4  # the pool grew, and was drawn from


def test_once_everything_is_admitted_an_epoch_is_a_permutation_of_the_data():
    sampler = CurriculumSampler(shuffled_scores(30), batch_size=4, duration=3)
    for epoch in (3, 4):
        sampler.set_epoch(epoch)
        assert sorted(sampler) == list(range(30))


def test_draws_within_a_pass_never_repeat():
    # step pacing, 2 stairs over 8 steps: 6 samples for steps 0-3 (12 draws: two passes), then 13 (steps 4-6).
    sampler = CurriculumSampler(torch.arange(20).double(), batch_size=3, duration=8, pacing="step",
                                start_fraction=0.3, stairs=2)
    draws = list(sampler)
    assert sorted(draws[:6]) == sorted(draws[6:12]) == list(range(6))
    assert sampler.pool_size(4) == 13 and len(set(draws[12:])) == 8 and set(draws[12:]) <= set(range(13))


@pytest.mark.parametrize("seed", range(5))
def test_samples_admitted_mid_pass_join_the_current_pass(seed):
    # pools 4, 5, 6, 7 for the 4 batches of 2: the first 6 draws are one pass over the 6 admitted by step 2.
    sampler = CurriculumSampler(torch.arange(8).double(), batch_size=2, duration=4, start_fraction=0.5,
                                seed=seed)
    assert [sampler.pool_size(t) for t in range(4)] == [4, 5, 6, 7]
    draws = list(sampler)
    assert set(draws[:2]) <= set(range(4)) and sorted(draws[:6]) == list(range(6))


def test_the_order_depends_only_on_seed_and_epoch():
    def draw(seed, epoch):
        sampler = CurriculumSampler(shuffled_scores(24), batch_size=4, duration=5, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert draw(0, 1) == draw(0, 1)
    assert draw(0, 1) != draw(0, 2) and draw(0, 1) != draw(1, 1)


def test_ties_are_broken_by_a_seeded_shuffle_not_by_position():
    scores = torch.tensor([1.0] * 50 + [0.0] * 50)  # sorted by label; a score that cannot split them
    orders = [CurriculumSampler(scores, batch_size=1, duration=1, seed=seed).order for seed in (0, 0, 1)]
    assert orders[0] == orders[1] != orders[2]
    for order in orders:
        assert sorted(order[:50]) == list(range(50, 100)) and sorted(order[50:]) == list(range(50))
        assert order[:50] != list(range(50, 100))


@pytest.mark.parametrize("replicas", [2, 3])
def test_ddp_shares_are_disjoint_and_together_are_what_one_process_draws(replicas):
    scores, per_rank_batch = shuffled_scores(48), 4
    single = CurriculumSampler(scores, batch_size=replicas * per_rank_batch, duration=3, start_fraction=0.25)
    ranks = [CurriculumSampler(scores, batch_size=per_rank_batch, duration=3, start_fraction=0.25,
                               num_replicas=replicas, rank=r) for r in range(replicas)]
    for epoch in range(4):
        for sampler in [single, *ranks]:
            sampler.set_epoch(epoch)
        shares = [batches(sampler) for sampler in ranks]
        for k, joint in enumerate(batches(single)):
            interleaved = [joint[j] for r in range(replicas) for j in range(r, len(joint), replicas)]
            assert [i for r in range(replicas) for i in shares[r][k]] == interleaved
            assert len(set(joint)) == len(joint)  # the pool of 12+ fills one global batch without repeats
        if epoch >= 1:  # step 3 on: all admitted, and the shares split the data
            assert sorted(i for share in shares for batch in share for i in batch) == list(range(48))


def test_uneven_data_pads_every_rank_to_the_same_length_or_drops_the_tail():
    padded = [CurriculumSampler(torch.arange(10).double(), 2, 1, num_replicas=3, rank=r) for r in range(3)]
    assert [len(s) for s in padded] == [4, 4, 4] and all(len(list(s)) == 4 for s in padded)
    dropped = [CurriculumSampler(torch.arange(10).double(), 2, 1, num_replicas=3, rank=r, drop_last=True)
               for r in range(3)]
    assert [len(s) for s in dropped] == [2, 2, 2] and dropped[0].full_batches == 1


def test_gradient_accumulation_holds_the_pool_for_a_whole_optimizer_step():
    sampler = CurriculumSampler(torch.arange(40).double(), batch_size=4, duration=4, start_fraction=0.1,
                                accumulate_grad_batches=3)
    assert sampler.full_batches == 10 and sampler.steps_per_epoch == 4  # the last step has one batch
    assert [sampler.step(0, k) for k in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert sampler.step(1, 0) == 4
    limited = CurriculumSampler(torch.arange(40).double(), 4, 4, batches_per_epoch=5,
                                accumulate_grad_batches=2)
    assert limited.steps_per_epoch == 3 and limited.step(1, 0) == 3


def test_a_changing_accumulation_schedule_paces_each_batch_by_its_windows_step():
    sampler = CurriculumSampler(shuffled_scores(40), batch_size=4, duration=6,
                                accumulate_grad_batches=AccumulationSchedule({0: 1, 2: 3}))
    assert [sampler.step(0, k) for k in range(10)] == [0, 1, 2, 2, 2, 3, 3, 3, 4, 4]  # windows 1, 1, 3, 3, 2
    assert sampler.step(1, 0) == 5 and sampler.steps_per_epoch == 5
    for step, drawn in zip([sampler.step(0, k) for k in range(10)], batches(sampler)):
        assert set(drawn) <= set(sampler.order[: sampler.pool_size(step)])


def test_a_resumed_sampler_paces_from_the_saved_optimizer_step_whatever_its_count():
    """Saved after 4 steps of 1 batch, resumed with 2 batches a step: batch 4 is still step 4, not 4 // 2."""
    sampler = CurriculumSampler(shuffled_scores(40), batch_size=4, duration=8, accumulate_grad_batches=2)
    sampler.load_state_dict({"epoch": 0, "batches": 4, "step": 4, "epoch_step": 0})
    assert [sampler.step(0, k) for k in range(4, 10)] == [4, 4, 5, 5, 6, 6]
    assert sampler.step(1, 0) == 7  # the rest of epoch 0 took steps 4-6
    assert sampler.state_dict() == {"epoch": 0, "batches": 4, "step": 4, "epoch_step": 0}
    limited = CurriculumSampler(shuffled_scores(40), batch_size=4, duration=8, batches_per_epoch=5)
    limited.load_state_dict({"epoch": 1, "batches": 2, "step": 12, "epoch_step": 10})  # saved with 10 a epoch
    assert limited.step(1, 2) == 12 and limited.step(2, 0) == 15


def test_a_restored_sampler_continues_the_same_draws():
    def make():
        return CurriculumSampler(shuffled_scores(32), batch_size=4, duration=6, start_fraction=0.25)

    straight = make()
    straight.set_epoch(1)
    reference = batches(straight)
    first = make()
    first.set_epoch(1)
    loader = iter(DataLoader(range(32), batch_size=4, sampler=first))
    taken = [next(loader).tolist() for _ in range(3)]
    state = first.state_dict()
    assert state == {"epoch": 1, "batches": 3, "step": 11, "epoch_step": 8} and taken == reference[:3]
    assert first.admitted_fraction == first.pool_size(first.step(1, 2)) / 32
    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # what a trainer does on resume: the loaded position stays
    assert [b.tolist() for b in DataLoader(range(32), batch_size=4, sampler=resumed)] == reference[3:]
    assert [b.tolist() for b in DataLoader(range(32), batch_size=4, sampler=resumed)] == reference  # afresh
    done = make()
    done.load_state_dict({"epoch": 1, "batches": 8})  # a complete epoch: go on with the next
    assert done.state_dict() == {"epoch": 2, "batches": 0, "step": 16, "epoch_step": 16}


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), [
    (([],), {}, ValueError,
     r"CurriculumSampler\(scores of shape \(0,\)\): scores must be a non-empty \(N,\) vector"),
    (([0.0, float("nan")],), {}, ValueError, r"CurriculumSampler: score 1 is nan; scores must be finite"),
    (([0.0],), {"batch_size": 0}, ValueError,
     r"CurriculumSampler\(batch_size=0\): batch_size must be an integer >= 1"),
    (([0.0],), {"pacing": "sigmoid"}, ValueError, r"CurriculumSampler\(pacing='sigmoid'\): pacing must be one of 'linear'"),
    (([0.0],), {"rank": 2, "num_replicas": 2}, ValueError,
     r"CurriculumSampler\(rank=2, num_replicas=2\): rank must be in \[0, num_replicas\)"),
    (([0.0] * 5,), {"batch_size": 3, "num_replicas": 2, "drop_last": True}, ValueError,
     r"CurriculumSampler\(drop_last=True\): 5 samples over 2 rank\(s\) do not fill one batch of 3"),
    (([0.0] * 5,), {"batches_per_epoch": 6}, ValueError,
     r"CurriculumSampler\(batches_per_epoch=6\): an epoch has only 5 batches here"),
    (([0.0],), {"seed": 1.5}, TypeError, r"CurriculumSampler\(seed=1\.5\): seed must be an integer >= 0"),
])
def test_bad_sampler_settings_are_refused(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        CurriculumSampler(*args, **{"batch_size": 1, "duration": 2, **kwargs})


def test_bad_positions_are_refused():
    sampler = CurriculumSampler([0.0] * 8, batch_size=2, duration=2)
    with pytest.raises(ValueError, match=r"CurriculumSampler\.load_state_dict\(\{'epoch': 0\}\): expected a "
                                         r"dict with 'epoch' and 'batches'"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match=r"CurriculumSampler\.load_state_dict\(batches=5\): an epoch has 4 "
                                         r"batches here; was the state saved with another batch size"):
        sampler.load_state_dict({"epoch": 0, "batches": 5})
    with pytest.raises(ValueError, match=r"CurriculumSampler\.set_epoch\(epoch=-1\): epoch must be an "
                                         r"integer >= 0"):
        sampler.set_epoch(-1)


# ----------------------------------------------------------------------------------------------- scoring


def test_length_scorer_counts_real_tokens():
    assert LengthScorer()({"input_ids": [1, 2, 3, 0], "attention_mask": [1, 1, 1, 0]}) == 3.0
    assert LengthScorer()({"input_ids": [1, 2, 3, 0]}) == 4.0
    assert LengthScorer(key=0, pad_token_id=0)((torch.tensor([4, 5, 0]), 1)) == 2.0
    with pytest.raises(TypeError, match=r"LengthScorer\(key='input_ids'\): a sample of type tuple has no "
                                        r"entry 'input_ids'; set key to where the token ids are"):
        LengthScorer()((torch.tensor([4, 5]), 1))


def test_scores_that_are_all_the_same_have_no_order_and_are_refused_naming_the_fix():
    """Padded samples without an attention mask: the length scorer counts the padding, every sample scores the
    padded length, and no curriculum can order them."""
    padded = [{"input_ids": torch.tensor([5] * n + [0] * (6 - n))} for n in (2, 6, 4)]
    scores = compute_scores(padded, LengthScorer())
    assert scores.tolist() == [6.0, 6.0, 6.0]
    with pytest.raises(ValueError, match=r"^Curriculum\(scorer='length'\): all 3 samples have the same score \(6\.0\), "
                                        r"so there is no easy-to-hard order and the curriculum would admit a random "
                                        r"share of the data; give the samples an attention_mask \(without one, "
                                        r"LengthScorer counts padding as tokens.*LengthScorer\(pad_token_id=<the pad "
                                        r"id>\) as the scorer\.$"):
        check_ordered(scores, "length", "Curriculum")
    with pytest.raises(ValueError, match=r"^CurriculumSampler\(scorer='loss'\): all 2 samples have the same score "
                                        r"\(0\.5\), .*; check the scorer: it gave every sample the same value\.$"):
        check_ordered(torch.tensor([0.5, 0.5]), "loss")
    with_mask = [{**sample, "attention_mask": (sample["input_ids"] > 0).long()} for sample in padded]
    check_ordered(compute_scores(with_mask, LengthScorer()), "length")  # [2, 6, 4]: ordered
    check_ordered(compute_scores(padded, LengthScorer(pad_token_id=0)), "length")
    check_ordered(torch.tensor([1.0]), "length")  # one sample: nothing to order, nothing random


class Counting:
    """A scorer that counts its calls (a plain function would do; this one also has a fingerprint)."""

    def __init__(self, offset: float = 0.0) -> None:
        self.calls, self.offset = 0, offset

    def __call__(self, sample):
        self.calls += 1
        return float(sample["input_ids"].sum()) + self.offset

    def fingerprint(self) -> str:
        return f"Counting(offset={self.offset})"


def data(n: int = 6, bump: int = 0) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.arange(i, i + 3) + (bump if i == 0 else 0), "labels": torch.tensor(i % 2)}
            for i in range(n)]


def test_scores_are_computed_once_and_cached_by_data_and_scorer(tmp_path):
    scorer = Counting()
    scores = compute_scores(data(), scorer, cache_dir=tmp_path)
    torch.testing.assert_close(scores, torch.tensor([3.0 * i + 3 for i in range(6)], dtype=torch.float64))
    assert scorer.calls == 6 and scores.dtype == torch.float64
    (cached,) = tmp_path.iterdir()  # one file, no temporary left behind
    assert cached.name.startswith("scores-") and cached.suffix == ".pt"
    again = Counting()
    assert torch.equal(compute_scores(data(), again, cache_dir=tmp_path), scores) and again.calls == 0
    other_data = Counting()
    compute_scores(data(bump=1), other_data, cache_dir=tmp_path)
    other_scorer = Counting(offset=1.0)
    assert compute_scores(data(), other_scorer, cache_dir=tmp_path)[0] == 4.0
    assert other_data.calls == 6 and other_scorer.calls == 6 and len(list(tmp_path.iterdir())) == 3
    named = Counting()
    compute_scores(data(bump=1), named, cache_dir=tmp_path, data_fingerprint="bbc-v1")
    compute_scores(data(), named, cache_dir=tmp_path, data_fingerprint="bbc-v1")  # the name is the data's key
    assert named.calls == 6


def first_token(sample, weight=1.0):
    return weight * float(sample["input_ids"][0])


def last_token(sample):
    return float(sample["input_ids"][-1])


def test_functions_are_keyed_by_name_code_and_bound_arguments(tmp_path):
    fingerprint = score_cache.scorer_fingerprint
    assert fingerprint(first_token) == fingerprint(first_token)
    scorers = [first_token, last_token, functools.partial(first_token, weight=2.0),
               functools.partial(first_token, weight=3.0), LengthScorer(), LengthScorer(pad_token_id=0)]
    assert len({fingerprint(scorer) for scorer in scorers}) == 6
    compute_scores(data(), first_token, cache_dir=tmp_path)
    compute_scores(data(), functools.partial(first_token, weight=2.0), cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2


MAX_TOKEN = 10


def capped(sample):
    return float(min(sample["input_ids"][0], MAX_TOKEN))


def threshold_scorer(limit):
    def score(sample):
        return float(sample["input_ids"][0] > limit)

    return score


def test_what_a_function_reads_besides_its_argument_is_in_the_key(monkeypatch):
    fingerprint = score_cache.scorer_fingerprint
    assert fingerprint(threshold_scorer(1)) == fingerprint(threshold_scorer(1))
    assert fingerprint(threshold_scorer(1)) != fingerprint(threshold_scorer(100))  # the captured value
    before = fingerprint(capped)
    monkeypatch.setitem(capped.__globals__, "MAX_TOKEN", 3)
    assert fingerprint(capped) != before  # the module-level constant it reads


def scaled(sample, *, weight=1.0):
    return weight * float(sample["input_ids"][0])


class Scaler:
    def __init__(self, weight: float) -> None:
        self.weight = weight

    def score(self, sample) -> float:
        return self.weight * float(sample["input_ids"][0])


def test_keyword_defaults_bound_objects_and_loss_scorer_settings_are_in_the_key():
    fingerprint = score_cache.scorer_fingerprint
    before = fingerprint(scaled)
    scaled.__kwdefaults__ = {"weight": 2.0}  # a keyword-only default changed: other scores
    try:
        assert fingerprint(scaled) != before
    finally:
        scaled.__kwdefaults__ = {"weight": 1.0}
    assert fingerprint(Scaler(1.0).score) == fingerprint(Scaler(1.0).score)
    assert fingerprint(Scaler(1.0).score) != fingerprint(Scaler(2.0).score)  # the method's object
    model = nn.Linear(4, 3)
    keys = {fingerprint(LossScorer(model, batch_size=2)), fingerprint(LossScorer(model, batch_size=4)),
            fingerprint(LossScorer(model, batch_size=2, collate_fn=lambda samples: samples))}
    assert len(keys) == 3  # batch size and collate function change padding, hence the losses


def test_a_method_of_an_object_without_state_to_key_is_refused():
    class Slots:
        __slots__ = ("weight",)

        def score(self, sample) -> float:
            return 0.0

    with pytest.raises(TypeError, match=r"cannot key the score cache by the state of a .*Slots .*fingerprint\(\)"):
        score_cache.scorer_fingerprint(Slots().score)


def test_an_interrupted_cache_write_leaves_no_file(tmp_path, monkeypatch):
    def crash(obj, path):
        with open(path, "wb") as file:
            file.write(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(score_cache.torch, "save", crash)
    with pytest.raises(OSError, match="No space left on device"):
        compute_scores(data(), Counting(), cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_cache_file_is_scored_again(tmp_path):
    compute_scores(data(), Counting(), cache_dir=tmp_path)
    (cached,) = tmp_path.iterdir()
    cached.write_bytes(b"garbage")
    scorer = Counting()
    compute_scores(data(), scorer, cache_dir=tmp_path)
    assert scorer.calls == 6 and torch.load(cached, weights_only=True)["scores"].shape == (6,)


def nan_at_2(sample):
    return float("nan") if int(sample["input_ids"][0]) == 2 else 1.0


def inf_at_1(sample):
    return float("inf") if int(sample["input_ids"][0]) == 1 else 1.0


class NoFingerprint:
    def __call__(self, sample):
        return 1.0


class WrongCount:
    batch_size = 4

    def __call__(self, sample):
        return 1.0

    def score_batch(self, samples):
        return [1.0]


@pytest.mark.parametrize(("dataset", "scorer", "kwargs", "error", "match"), [
    (data(), nan_at_2, {}, ValueError,
     r"compute_scores: nan_at_2 gave nan for sample 2; scores must be finite\. Fix the scorer or the sample"),
    (data(), inf_at_1, {}, ValueError,
     r"compute_scores: inf_at_1 gave inf for sample 1; scores must be finite"),
    (data(), lambda s: "easy", {}, TypeError,
     r"compute_scores: <lambda> returned a str for sample 0; a scorer must return a number"),
    ([], first_token, {}, ValueError,
     r"compute_scores: the dataset is empty, so there is nothing for first_token to score"),
    (data(), WrongCount(), {}, ValueError,
     r"compute_scores: WrongCount\.score_batch returned 1 scores for 4 samples"),
    (data(), NoFingerprint(), {"cache_dir": "unused"}, TypeError,
     (r"compute_scores: cannot key the score cache by NoFingerprint, a NoFingerprint without a fingerprint; "
      r"give it a fingerprint\(\) method")),
    ([{"input_ids": object()}], first_token, {"cache_dir": "unused"}, TypeError,
     (r"compute_scores: sample 0 holds a object, which the score cache cannot hash; pass "
      r"compute_scores\(\.\.\., data_fingerprint=")),
])
def test_bad_scores_and_scorers_are_refused(dataset, scorer, kwargs, error, match):
    with pytest.raises(error, match=match):
        compute_scores(dataset, scorer, **kwargs)


class Tiny(nn.Module):
    """Logits (B, 3) from token ids (B, T); dropout shows whether it runs in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, input_ids):
        return self.drop(self.embed(input_ids).mean(1))  # (B, 3)


def test_loss_scorer_gives_each_samples_loss_in_eval_mode_and_restores_the_modes():
    torch.manual_seed(0)
    model = Tiny().train()
    model.embed.eval()  # a submodule the caller put in eval mode stays there
    samples = [(torch.tensor([i, i + 1, 2]), torch.tensor(i % 3)) for i in range(5)]
    scores = compute_scores(samples, LossScorer(model, batch_size=2))
    with torch.no_grad():
        logits = model.embed(torch.stack([s[0] for s in samples])).mean(1)
        expected = nn.functional.cross_entropy(logits, torch.stack([s[1] for s in samples]), reduction="none")
    torch.testing.assert_close(scores, expected.double())
    assert model.training and model.drop.training and not model.embed.training
    before = LossScorer(model).fingerprint()
    with torch.no_grad():
        model.embed.weight[0, 0] += 1
    assert LossScorer(model).fingerprint() != before  # new weights, new cache key


def test_loss_scorer_reads_dict_batches_and_takes_a_custom_loss():
    model = Tiny().eval()
    samples = [{"input_ids": torch.tensor([1, 2]), "labels": torch.tensor(0)}] * 2
    scores = compute_scores(samples, LossScorer(model, loss_fn=lambda m, b: m(b["input_ids"]).sum(1)))
    torch.testing.assert_close(scores, model(torch.tensor([[1, 2]] * 2)).sum(1).double().detach())
    assert compute_scores(samples, LossScorer(model)).shape == (2,)  # dict batches for the default loss too


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"model": "bert"}, TypeError, r"LossScorer\(model=str\): model must be a torch\.nn\.Module"),
    ({"batch_size": 0}, ValueError, r"LossScorer\(batch_size=0\): batch_size must be an integer >= 1"),
    ({"loss_fn": "ce"}, TypeError, r"LossScorer\(loss_fn='ce'\): loss_fn must be callable or None"),
])
def test_bad_loss_scorer_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        LossScorer(**{"model": Tiny(), **kwargs})


def test_the_default_loss_wants_class_logits():
    model = nn.Embedding(10, 4)  # (B, T) ids -> (B, T, 4): token logits
    with pytest.raises(ValueError, match=r"LossScorer: the default loss takes logits \(B, C\) and labels "
                                         r"\(B,\), got logits \(1, 2, 4\) and labels \(1,\); pass loss_fn="):
        classification_loss(model, (torch.tensor([[1, 2]]), torch.tensor([0])))


# ---------------------------------------------------------------------------------- sequence-length warm-up


def test_warmup_length_rises_in_multiples_of_8_to_the_maximum():
    assert [warmup_length(t, 8, 64, 8) for t in range(10)] == [8, 8, 16, 24, 32, 40, 48, 56, 64, 64]
    assert [warmup_length(t, 12, 30, 3) for t in range(4)] == [12, 12, 20, 30]  # from 12 by 8, capped
    assert warmup_length(5, 16, 16, 2) == 16


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"min_length": 0}, ValueError, r"warmup_length\(min_length=0\): min_length must be an integer >= 1"),
    ({"min_length": 64, "max_length": 32}, ValueError,
     r"warmup_length\(min_length=64, max_length=32\): min_length must be <= max_length"),
    ({"duration": "10"}, TypeError, r"warmup_length\(duration='10'\): duration must be an integer >= 1"),
])
def test_bad_warmup_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        warmup_length(**{"step": 0, "min_length": 8, "max_length": 32, "duration": 10, **kwargs})


def test_truncate_batch_cuts_the_token_tensors_only():
    batch = {"input_ids": torch.arange(12).view(2, 6), "attention_mask": torch.ones(2, 6),
             "labels": torch.tensor([0, 1]), "token_labels": torch.zeros(2, 6), "pixel": torch.zeros(2, 3)}
    cut = truncate_batch({**batch, "token_type_ids": torch.zeros(2, 6)}, 4)
    assert {k: tuple(v.shape) for k, v in cut.items()} == {
        "input_ids": (2, 4), "attention_mask": (2, 4), "labels": (2,), "token_labels": (2, 6),
        "pixel": (2, 3), "token_type_ids": (2, 4)}
    assert torch.equal(cut["input_ids"], batch["input_ids"][:, :4]) and batch["input_ids"].shape == (2, 6)
    assert truncate_batch(batch, 10)["input_ids"].shape == (2, 6)
    token_labels = truncate_batch({"input_ids": torch.zeros(2, 6), "labels": torch.zeros(2, 6)}, 2)["labels"]
    assert token_labels.shape == (2, 2)


@pytest.mark.parametrize(("batch", "length", "error", "match"), [
    ((torch.zeros(2, 4),), 2, TypeError,
     r"truncate_batch: the batch is a tuple; it must be a dict of \(B, T\) tensors"),
    ({"ids": torch.zeros(2, 4)}, 2, ValueError,
     r"truncate_batch: the batch needs an input_ids tensor of shape \(B, T\); its keys are \['ids'\]"),
    ({"input_ids": torch.zeros(2, 4)}, 0, ValueError,
     r"truncate_batch\(length=0\): length must be an integer >= 1"),
])
def test_bad_batches_are_refused(batch, length, error, match):
    with pytest.raises(error, match=match):
        truncate_batch(batch, length)

