"""`HFCausalLM` under DDP, 2 CPU processes on gloo: each rank's packed batches hold a different number of target
tokens, and the training loss is still the token mean of the global batch. Every gradient (after DDP's average) and
the logged ``train_loss`` equal one process on the two ranks' rows packed into one batch (float64)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from lightning_peft.data.sft import pack_examples

from . import hf_causal_lm_script as script

pytest.importorskip("transformers")


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ddp_gradients_are_those_of_the_token_mean_of_the_global_batch(two_ranks, tmp_path):
    ranks = [torch.load(two_ranks.path("hf_causal_lm") / f"rank{r}.pt") for r in (0, 1)]
    joint = [pack_examples(script.rows(0, step) + script.rows(1, step)) for step in range(script.STEPS)]
    single = script.fit(tmp_path, 1, joint)

    assert ranks[0]["tokens"] != ranks[1]["tokens"]  # the ranks hold different numbers of targets
    assert [a + b for a, b in zip(ranks[0]["tokens"], ranks[1]["tokens"])] == single["tokens"]
    for step in range(script.STEPS):
        assert single["grads"][step].keys() == ranks[0]["grads"][step].keys()
        for name, grad in single["grads"][step].items():
            for rank in ranks:
                assert_close(rank["grads"][step][name], grad, rtol=1e-9, atol=1e-12, msg=f"step {step}: {name}")
    assert any(g.abs().max() > 0 for g in single["grads"][1].values())
    for rank in ranks:  # the logged loss is the global token mean, on every rank
        assert_close(torch.tensor(rank["losses"]), torch.tensor(single["losses"]), rtol=1e-10, atol=0)
        for key, value in single["adapter"].items():
            assert_close(rank["adapter"][key], value, rtol=1e-8, atol=1e-10, msg=key)
