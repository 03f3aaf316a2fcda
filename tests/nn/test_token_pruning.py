"""TokenPruner: the selection rule exactly, and the encoder with a pruner against a float64 reference by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_peft.nn.token_pruning import TokenPruner, kept_count

# ---------------------------------------------------------------------------------------------------------------
# The selection rule
# ---------------------------------------------------------------------------------------------------------------


def reference_select(importance: torch.Tensor, mask: torch.Tensor | None, ratio: float) -> list[list[int]]:
    """Index 0, then real tokens by decreasing importance, then padding; the first K, ascending (plain Python).

    Padding tokens tie with each other (any of them may fill the places left): they are given as -1.
    """
    batch, length = importance.shape
    count = max(1, math.ceil(ratio * length - 1e-9))
    rows = []
    for b in range(batch):
        real = [j for j in range(1, length) if mask is None or bool(mask[b, j])]
        pad = [j for j in range(1, length) if mask is not None and not bool(mask[b, j])]
        ranked = [0, *sorted(real, key=lambda j: -float(importance[b, j])), *[-1] * len(pad)]
        rows.append(sorted(ranked[:count]))
    return rows


@pytest.mark.parametrize("ratio", [1.0, 0.9, 0.7, 0.5, 0.3, 0.01])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_select_keeps_the_first_token_and_the_most_important_real_ones_in_order(ratio, dtype):
    generator = torch.Generator().manual_seed(0)
    importance = torch.randperm(6 * 23, generator=generator).reshape(6, 23).to(dtype)  # distinct, exact in bf16
    lengths = torch.tensor([23, 20, 11, 5, 2, 1])
    mask = torch.arange(23) < lengths[:, None]  # (B, L): right padding
    for m in (mask, None):
        keep = TokenPruner().select(importance, m, ratio)
        assert keep.dtype == torch.long and keep.shape == (6, kept_count(23, ratio))
        padded = torch.where(m.gather(1, keep), keep, -1) if m is not None else keep
        assert padded.sort(dim=1).values.tolist() == reference_select(importance.double(), m, ratio)
        assert (keep[:, 0] == 0).all() and (keep.diff(dim=1) > 0).all()  # index 0 first, ascending, no repeats


def test_index_0_is_kept_even_when_least_important_and_padding_loses_to_every_real_token():
    importance = torch.tensor([[-5.0, 1e-9, 0.0, 9.0, 8.0, 7.0]])
    mask = torch.tensor([[True, True, True, False, False, False]])  # the padding has the highest scores
    assert TokenPruner().select(importance, mask, 0.5).tolist() == [[0, 1, 2]]
    assert TokenPruner().select(importance, None, 0.5).tolist() == [[0, 3, 4]]
    # More tokens kept than real ones: every real token, then padding.
    keep = TokenPruner().select(importance, mask, 0.7)  # ceil(4.2) = 5
    assert keep.shape == (1, 5) and keep[0, :3].tolist() == [0, 1, 2]
    assert TokenPruner().select(importance, mask, 0.01).tolist() == [[0]]  # at least one token: the first


@pytest.mark.parametrize(("length", "ratio", "expected"), [
    (10, 0.5, 5), (11, 0.5, 6), (128, 0.7, 90), (100, 0.07, 7), (3, 0.7, 3), (10, 1e-6, 1), (7, 1.0, 7),
    (49, 0.3, 15), (6, 1 / 3, 2),
])
def test_kept_count_is_ceil_of_ratio_times_length(length, ratio, expected):
    assert kept_count(length, ratio) == expected
    keep = TokenPruner().select(torch.rand(2, length), None, ratio)
    assert keep.shape == (2, expected)


def test_keep_ratio_at_follows_start_layer_the_schedule_and_the_scale():
    pruner = TokenPruner(keep_ratio=0.6, start_layer=2)
    assert [pruner.keep_ratio_at(i, 5) for i in range(5)] == [1.0, 1.0, 0.6, 0.6, 0.6]
    pruner.scale = 0.5
    assert [pruner.keep_ratio_at(i, 5) for i in range(5)] == pytest.approx([1.0, 1.0, 0.8, 0.8, 0.8], abs=1e-15)
    pruner.scale = 0.0
    assert [pruner.keep_ratio_at(i, 5) for i in range(5)] == [1.0] * 5
    schedule = TokenPruner(keep_ratio=[1.0, 0.9, 0.5], start_layer=2)  # start_layer ignored with a schedule
    assert [schedule.keep_ratio_at(i, 3) for i in range(3)] == [1.0, 0.9, 0.5]
    assert TokenPruner(0.5, start_layer=0).keep_ratio_at(0, 2) == 0.5


def test_token_counts_compound_per_layer():
    assert TokenPruner(0.5).token_counts(128, 6) == [128, 64, 32, 16, 8, 4]
    assert TokenPruner(0.7, start_layer=2).token_counts(100, 4) == [100, 100, 70, 49]
    assert TokenPruner([0.5, 1.0, 0.5]).token_counts(10, 3) == [5, 5, 3]
    off = TokenPruner(0.5)
    off.scale = 0.0
    assert off.token_counts(10, 3) == [10, 10, 10]


def test_the_pruner_has_no_parameters_and_shows_its_settings():
    pruner = TokenPruner(keep_ratio=0.7, start_layer=1, importance="cls")
    assert list(pruner.parameters()) == [] and pruner.state_dict() == {}
    assert repr(pruner) == "TokenPruner(keep_ratio=0.7, start_layer=1, importance='cls', scale=1)"


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"keep_ratio": 0.0}, ValueError, r"TokenPruner\(keep_ratio=0\.0\): keep_ratio must be a finite number in \(0, 1\]"),
    ({"keep_ratio": 1.5}, ValueError, r"TokenPruner\(keep_ratio=1\.5\): keep_ratio must be a finite number in \(0, 1\]"),
    ({"keep_ratio": float("nan")}, ValueError, r"keep_ratio=nan\): keep_ratio must be a finite number in \(0, 1\]"),
    ({"keep_ratio": [1.0, -0.5]}, ValueError, r"TokenPruner\(keep_ratio\[1\]=-0\.5\): keep_ratio\[1\] must be"),
    ({"keep_ratio": []}, ValueError, r"TokenPruner\(keep_ratio=\[\]\): an empty schedule"),
    ({"keep_ratio": "0.5"}, TypeError, r"TokenPruner\(keep_ratio='0\.5'\): keep_ratio must be a finite number"),
    ({"keep_ratio": True}, TypeError, r"TokenPruner\(keep_ratio=True\): keep_ratio must be a finite number"),
    ({"start_layer": -1}, ValueError, r"TokenPruner\(start_layer=-1\): start_layer must be an integer >= 0"),
    ({"start_layer": 1.0}, TypeError, r"TokenPruner\(start_layer=1\.0\): start_layer must be an integer"),
    ({"importance": "max"}, ValueError, r"TokenPruner\(importance='max'\): importance must be one of 'mean', 'cls'"),
])
def test_bad_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        TokenPruner(**kwargs)


def test_a_schedule_of_the_wrong_length_names_both_lengths():
    pruner = TokenPruner(keep_ratio=[1.0, 0.5, 0.5])
    with pytest.raises(ValueError, match=r"TokenPruner\(keep_ratio=\[1\.0, 0\.5, 0\.5\]\): a schedule of 3 ratios for "
                                         r"an encoder of 6 layers; give exactly one ratio per layer \(6\)"):
        pruner.keep_ratio_at(0, 6)
    with pytest.raises(ValueError, match=r"layer_index=3\): layer_index must be an integer in \[0, 2\] \(a layer of an encoder with 3 layers\)"):
        pruner.keep_ratio_at(3, 3)


@pytest.mark.parametrize(("args", "error", "match"), [
    ((torch.rand(2, 4), None, 0.0), ValueError, r"TokenPruner\.select\(keep_ratio=0\.0\): keep_ratio must be a "
                                                r"finite number in \(0, 1\]"),
    ((torch.rand(2, 4), None, 1.01), ValueError, r"keep_ratio=1\.01\): keep_ratio must be a finite number in \(0, 1\]"),
    ((torch.rand(2, 4, 1), None, 0.5), ValueError, r"importance has shape \(2, 4, 1\); it must be \(batch, tokens\)"),
    ((torch.rand(2, 4), torch.ones(2, 4), 0.5), TypeError, r"key_padding_mask is torch\.float32; it must be a bool"),
    ((torch.rand(2, 4), torch.ones(2, 3, dtype=torch.bool), 0.5), ValueError,
     r"key_padding_mask has shape \(2, 3\), importance \(2, 4\); they must be the same"),
])
def test_bad_select_inputs_are_refused(args, error, match):
    with pytest.raises(error, match=match):
        TokenPruner().select(*args)


@pytest.mark.parametrize(("value", "error"), [(-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                            ("1", TypeError)])
def test_a_scale_outside_0_1_is_refused(value, error):
    pruner = TokenPruner()
    with pytest.raises(error, match=r"TokenPruner\(scale=.*\): scale must be a finite number in \[0, 1\]"):
        pruner.scale = value
    assert pruner.scale == 1.0


# ---------------------------------------------------------------------------------------------------------------
# In the encoder
# ---------------------------------------------------------------------------------------------------------------

HIDDEN, HEADS, LAYERS = 16, 2, 3


def tiny_encoder(seed: int = 0, **kwargs) -> torch.nn.Module:
    from lightning_peft.nn.transformer import TransformerEncoder

    torch.manual_seed(seed)
    encoder = TransformerEncoder(vocab_size=40, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, ffn_size=32,
                                 max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, **kwargs)
    return encoder.eval()


def batch(lengths: list[int], length: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (len(lengths), length), generator=generator)
    mask = (torch.arange(length) < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask  # padding id 0


def reference_row(encoder, ids: torch.Tensor, mask: torch.Tensor, pruner: TokenPruner | None) -> torch.Tensor:
    """One sample through the encoder's weights by hand, in float64: BERT post-norm layers; after layer i's
    attention sublayer, the reference rule keeps ``ceil(r_i * n)`` tokens (importance from its own softmax), the
    dropped ones keep that state, the kept ones go on through the feed-forward and the next layers. (L, H)."""
    w = {k: v.double() for k, v in encoder.state_dict().items()}
    ln = torch.nn.functional.layer_norm
    eps = encoder.config["norm_eps"]
    length = ids.shape[0]
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:length]
    x = ln(x + w["embeddings.token_type_embeddings.weight"][0], (HIDDEN,), w["embeddings.norm.weight"],
           w["embeddings.norm.bias"], eps)
    out = x.clone()
    real, positions = mask.bool(), torch.arange(length)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"layers.{i}."

        def proj(name: str, h: torch.Tensor) -> torch.Tensor:
            return h @ w[f"{p}{name}.weight"].T + w[f"{p}{name}.bias"]

        n = x.shape[0]
        q, k, v = (proj(f"attn.{name}_proj", x).view(n, HEADS, head_dim).transpose(0, 1) for name in "qkv")
        scores = (q @ k.transpose(1, 2) / math.sqrt(head_dim)).masked_fill(~real, float("-inf"))  # (nh, n, n)
        probs = scores.softmax(-1)
        attended = (probs @ v).transpose(0, 1).reshape(n, HIDDEN)
        x = ln(x + proj("attn.o_proj", attended), (HIDDEN,), w[f"{p}attn_norm.weight"], w[f"{p}attn_norm.bias"], eps)
        ratio = 1.0 if pruner is None else pruner.keep_ratio_at(i, LAYERS)
        if ratio < 1.0:
            if pruner.importance == "mean":
                importance = probs[:, real].mean(dim=(0, 1))  # over heads and real queries
            else:
                importance = probs[:, 0].mean(dim=0)  # the first query's row, over heads
            (keep,) = reference_select(importance[None], real[None], ratio)
            keep = torch.tensor([j if j >= 0 else next(t for t in range(n) if not real[t] and t not in keep)
                                 for j in keep]).sort().values  # any padding fills the places left
            out[positions] = x
            x, real, positions = x[keep], real[keep], positions[keep]
        hidden = torch.nn.functional.gelu(proj("mlp.up_proj", x))
        x = ln(x + proj("mlp.down_proj", hidden), (HIDDEN,), w[f"{p}mlp_norm.weight"], w[f"{p}mlp_norm.bias"], eps)
    out[positions] = x
    return out


def test_keep_ratio_1_and_scale_0_give_exactly_the_unpruned_outputs():
    encoder = tiny_encoder()
    ids, mask = batch([12, 7, 3], 12)
    with torch.no_grad():
        plain = encoder(ids, mask)
        encoder.token_pruner = TokenPruner(keep_ratio=1.0, start_layer=0)
        assert torch.equal(encoder(ids, mask), plain)
        encoder.token_pruner = TokenPruner(keep_ratio=[1.0, 1.0, 1.0])
        assert torch.equal(encoder(ids, mask), plain)
        off = TokenPruner(keep_ratio=0.3, start_layer=0)
        off.scale = 0.0
        encoder.token_pruner = off
        assert torch.equal(encoder(ids, mask), plain)
        off.scale = 1.0
        assert not torch.allclose(encoder(ids, mask)[:, 0], plain[:, 0])  # the same pruner does prune at scale 1


@pytest.mark.parametrize("importance", ["mean", "cls"])
@pytest.mark.parametrize("keep_ratio", [0.5, 0.7, [0.6, 1.0, 0.5]])
def test_pruned_outputs_equal_the_layers_run_by_hand_on_the_kept_tokens(importance, keep_ratio):
    encoder = tiny_encoder().double()
    pruner = TokenPruner(keep_ratio=keep_ratio, start_layer=1, importance=importance)
    encoder.token_pruner = pruner
    ids, mask = batch([16, 11, 5, 2], 16)
    with torch.no_grad():
        got = encoder(ids, mask)
    assert got.shape == (4, 16, HIDDEN)
    counts = pruner.token_counts(16, LAYERS)
    for b in range(4):
        expected = reference_row(encoder, ids[b], mask[b], pruner)
        real = mask[b].bool()
        torch.testing.assert_close(got[b, real], expected[real], rtol=1e-10, atol=1e-10)
        kept_real = min(int(real.sum()), counts[-1])
        assert int(encoder.last_kept_tokens[-1][b]) == kept_real
    assert [int(c[0]) for c in encoder.last_kept_tokens] == counts  # the unpadded sample: the rule's counts


def test_a_padded_sample_gives_its_own_outputs_where_the_kept_counts_allow():
    encoder = tiny_encoder().double()
    encoder.token_pruner = TokenPruner(keep_ratio=0.7, start_layer=1)
    ids, mask = batch([12, 7, 3], 12)
    with torch.no_grad():
        together = encoder(ids, mask)
        alone_long = encoder(ids[:1], mask[:1])  # the same length: the same kept counts
        alone_short = encoder(ids[2:, :3], mask[2:, :3])  # 3 tokens keep ceil(0.7 * 3) = 3: nothing dropped alone,
    # and in the batch, 12 -> 9 -> 7 kept tokens leave room for its 3 real ones: nothing of it dropped either.
    assert encoder.token_pruner.token_counts(12, LAYERS) == [12, 9, 7]
    torch.testing.assert_close(together[0], alone_long[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(together[2, :3], alone_short[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(encoder.pooled(together)[2], encoder.pooled(alone_short)[0], rtol=1e-12, atol=1e-12)


def test_pruned_float32_matches_the_float64_reference_and_trains():
    encoder = tiny_encoder()
    encoder.token_pruner = TokenPruner(keep_ratio=0.5, start_layer=1)
    ids, mask = batch([10, 6], 10)
    got = encoder(ids, mask)
    for b in range(2):
        real = mask[b].bool()
        expected = reference_row(encoder, ids[b], mask[b], encoder.token_pruner)
        torch.testing.assert_close(got[b, real].double(), expected[real], rtol=1e-5, atol=1e-5)
    encoder.pooled(got).square().sum().backward()
    grads = [p.grad for p in encoder.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert encoder.layers[-1].mlp.up_proj.weight.grad.abs().sum() > 0  # the kept tokens reach the last layer
