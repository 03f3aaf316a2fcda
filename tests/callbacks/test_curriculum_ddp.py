"""Curriculum under DDP, 2 CPU processes on gloo: each global batch is split into disjoint rank shares that
together are what one process draws; once everything is admitted an epoch's shares cover the data exactly; a
scoring error on rank 0 stops rank 1 too."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_peft.training import CurriculumSampler, compute_scores

from . import ddp_curriculum_script as script


@pytest.mark.multiprocess
def test_ddp_ranks_train_on_disjoint_shares_of_the_curriculum(two_ranks):
    out = two_ranks.path("curriculum_ddp")
    ranks = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    assert torch.equal(ranks[0]["scores"], ranks[1]["scores"])  # rank 0's scores, broadcast
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (script.SAMPLES, 4), generator=generator)
    scores = compute_scores([(row,) for row in ids], script.token_sum)
    assert torch.equal(ranks[0]["scores"], scores)

    batches_per_epoch = script.SAMPLES // 2 // script.BATCH_SIZE
    single = CurriculumSampler(scores, batch_size=2 * script.BATCH_SIZE, duration=script.DURATION,
                               start_fraction=0.25, seed=5)
    for epoch in range(2):
        single.set_epoch(epoch)
        joint = [b.tolist() for b in DataLoader(range(script.SAMPLES), batch_size=4, sampler=single)]
        for k in range(batches_per_epoch):
            zero, one = (ranks[r]["seen"][epoch * batches_per_epoch + k] for r in (0, 1))
            assert not set(zero) & set(one), (epoch, k)  # disjoint shares of one global batch
            assert zero == joint[k][0::2] and one == joint[k][1::2]  # which together are one process's batch
            assert set(zero + one) <= set(single.order[: single.pool_size(epoch * batches_per_epoch + k)])
    last_epoch = [i for r in (0, 1) for batch in ranks[r]["seen"][batches_per_epoch:] for i in batch]
    assert sorted(last_epoch) == list(range(script.SAMPLES))  # all admitted: disjoint and covering

    zero = (out / "failing-rank0.txt").read_text()
    assert zero.startswith("ValueError: compute_scores: nan_score gave nan for sample 0; scores must be "
                           "finite.")
    assert (out / "failing-rank1.txt").read_text() == (
        f"RuntimeError: Curriculum: scoring on rank 0 failed ({zero}); stopping this rank as well.")
