"""PEFT under DDP, 2 CPU processes on gloo. LoRA (+ GradientNoise): the same adapter on both ranks as a single
process on the full batch, so the noise was the same on both ranks and equal to the single process's. Every other
PEFT technique (MultiLoRA, BottleneckAdapters, PromptTuning, PrefixTuning), in the same launch: identical replicas,
equal to one process on the joint batch, an adapter-only checkpoint written by rank 0."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from . import ddp_lora_script as script


@pytest.mark.multiprocess
def test_ddp_two_processes_equal_one_process_on_the_joint_batch(two_ranks, tmp_path):
    ddp = two_ranks.path("lora_ddp") / "ddp"  # the 2-rank fits (job lora_ddp of tests/_two_ranks.py)
    script.main(tmp_path / "single", devices=1, batch_size=8)  # the reference: one process, the joint batch
    script.others(tmp_path / "single", devices=1, batch_size=8)
    rank0, rank1 = (torch.load(ddp / f"rank{r}.pt") for r in (0, 1))
    single = torch.load(tmp_path / "single" / "rank0.pt")
    assert rank0.keys() == single.keys()
    for key in single:
        assert torch.equal(rank0[key], rank1[key]), key  # DDP keeps the replicas identical
        assert_close(rank0[key], single[key], rtol=1e-5, atol=1e-6)  # and averages gradients correctly
    # Rank 0 alone wrote the export and an adapter-only checkpoint.
    assert (ddp / "export-rank0.txt").read_text() == "['adapter', 'merged']"
    assert (ddp / "export-rank1.txt").read_text() == "[]"
    assert (ddp / "export" / "merged" / "model.safetensors").is_file()
    state = torch.load(ddp / "ckpt" / "last.ckpt", weights_only=False)["state_dict"]
    assert set(state) == {f"model.{k}" for k in single}
    # An export failing on rank 0 raised there and, through a broadcast, on rank 1 as well.
    assert (ddp / "failing-rank0.txt").read_text() == "OSError: No space left on device"
    assert (ddp / "failing-rank1.txt").read_text() == (
        "RuntimeError: MergeOnSave: the export on rank 0 failed (OSError: No space left on device); "
        "stopping this rank as well."
    )
    for name in ("multi_lora", "bottleneck", "prompt_tuning", "prefix_tuning"):
        rank0, rank1 = (torch.load(ddp / f"{name}-rank{r}.pt") for r in (0, 1))
        single = torch.load(tmp_path / "single" / f"{name}-rank0.pt")
        assert rank0.keys() == single.keys(), name
        for key in single:
            assert torch.equal(rank0[key], rank1[key]), (name, key)
            assert_close(rank0[key], single[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
        state = torch.load(ddp / name / "last.ckpt", weights_only=False)["state_dict"]
        assert set(state) == {f"model.{k}" for k in single}, name  # rank 0 wrote it, adapter-only
    # MultiLoRA's logged sample counts are the whole batch's on every rank, as one process logs them.
    counts = [torch.load(ddp / f"multi_lora-counts-rank{r}.pt") for r in (0, 1)]
    single = torch.load(tmp_path / "single" / "multi_lora-counts-rank0.pt")
    assert single == {"train_adapter_samples/news": 12.0, "train_adapter_samples/sport": 4.0}
    assert counts[0] == counts[1] == single


@pytest.mark.multiprocess
def test_ddp_resume_with_dropout_restores_each_ranks_generators(two_ranks):
    """Two ranks with their own generators (different dropout masks): resumed mid-epoch and at an epoch boundary,
    each rank ends with the straight run's adapter, to the bit; the checkpoint holds both ranks' generators."""
    out = two_ranks.path("lora_ddp") / "rng"
    ranks = [torch.load(out / f"rng-rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["first_draw"] != ranks[1]["first_draw"]  # the ranks did draw differently
    for rank in ranks:
        for resumed in ("mid", "boundary"):
            for key, value in rank["straight"].items():
                assert torch.equal(rank[resumed][key], value), (resumed, key)
    saved = torch.load(out / "straight" / "steps" / "step=2.ckpt", weights_only=False)
    states = saved["callbacks"]["lightning_peft.RNGState"]["ranks"]
    assert len(states) == 2 and not torch.equal(states[0]["torch"], states[1]["torch"])
