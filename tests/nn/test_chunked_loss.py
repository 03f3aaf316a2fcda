"""chunked_cross_entropy against plain F.cross_entropy on the full logits: loss and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_peft.nn import chunked_cross_entropy

N, H, V = 13, 6, 11  # 13 rows: chunk sizes 1, 4 (does not divide), 13 and 32 (> N)


def _inputs(dtype=torch.float64, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator, dtype=torch.float64)  # (N, H)
    weight = torch.randn(V, H, generator=generator, dtype=torch.float64)  # (V, H)
    b = torch.randn(V, generator=generator, dtype=torch.float64) if bias else None  # (V,)
    labels = torch.randint(0, V, (N,), generator=generator)
    labels[[2, 3, 9]] = -100
    tensors = [t.to(dtype).requires_grad_() if t is not None else None for t in (hidden, weight, b)]
    return (*tensors, labels)


def _plain(hidden, weight, bias, labels, reduction="mean"):
    logits = hidden @ weight.T + (bias if bias is not None else 0)  # (N, V)
    return F.cross_entropy(logits.float() if logits.dtype != torch.float64 else logits, labels,
                           reduction=reduction)


def _loss_and_grads(fn, hidden, weight, bias, labels, upstream=1.0, **kwargs):
    loss = fn(hidden, weight, bias, labels, **kwargs)
    wanted = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(loss * upstream, wanted)
    return loss.detach(), grads


def _chunked(hidden, weight, bias, labels, reduction="mean", chunk_size=4):
    return chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, reduction=reduction, bias=bias)


@pytest.mark.parametrize("chunk_size", [1, 4, 13, 32])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradients_equal_plain_cross_entropy_in_float64(chunk_size, reduction):
    hidden, weight, bias, labels = _inputs()
    expected, expected_grads = _loss_and_grads(_plain, hidden, weight, bias, labels, 1.7, reduction=reduction)
    loss, grads = _loss_and_grads(_chunked, hidden, weight, bias, labels, 1.7, reduction=reduction,
                                  chunk_size=chunk_size)
    assert loss.dtype == torch.float64 and len(grads) == 3
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert bool((grads[0][[2, 3, 9]] == 0).all())  # ignored rows get no gradient


def test_frozen_head_no_bias_three_dimensional_input_and_all_ignored():
    hidden, weight, _, labels = _inputs(bias=False)
    weight.requires_grad_(False)  # a frozen head: only hidden gets a gradient
    hidden_3d, labels_3d = hidden.detach()[:12].reshape(3, 4, H).requires_grad_(), labels[:12].reshape(3, 4)
    loss = chunked_cross_entropy(hidden_3d, weight, labels_3d, chunk_size=5)
    (grad,) = torch.autograd.grad(loss, hidden_3d)
    reference = hidden_3d.detach().requires_grad_()
    expected = F.cross_entropy((reference @ weight.T).reshape(12, V), labels_3d.reshape(12))
    (expected_grad,) = torch.autograd.grad(expected, reference)
    assert grad.shape == (3, 4, H)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    # every label ignored: F.cross_entropy's mean is nan with zero gradients, its sum 0; the same here
    ignored = torch.full((N,), -100)
    for reduction in ("mean", "sum"):
        loss, (grad,) = _loss_and_grads(_chunked, hidden, weight, None, ignored, reduction=reduction)
        expected, (expected_grad,) = _loss_and_grads(_plain, hidden, weight, None, ignored, reduction=reduction)
        torch.testing.assert_close(loss, expected, equal_nan=True)
        torch.testing.assert_close(grad, expected_grad)
    with torch.no_grad():  # no gradients wanted: the loss alone
        assert torch.allclose(chunked_cross_entropy(hidden, weight, labels, chunk_size=3), _plain(hidden, weight,
                                                                                                   None, labels))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs_match_a_float32_reference_and_keep_their_dtype(dtype):
    hidden, weight, bias, labels = _inputs(dtype)
    loss, grads = _loss_and_grads(_chunked, hidden, weight, bias, labels)
    reference = [t.detach().float().requires_grad_() for t in (hidden, weight, bias)]
    expected, expected_grads = _loss_and_grads(_plain, *reference, labels)
    assert loss.dtype == torch.float32
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(loss, expected, **tolerance)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, **tolerance)


def test_bad_chunk_size_shapes_dtypes_and_labels_are_named():
    hidden, weight, bias, labels = _inputs()
    with pytest.raises(ValueError, match=r"^chunked_cross_entropy\(chunk_size=0\): chunk_size must be an integer "
                                         r">= 1, e\.g\. 1024"):
        chunked_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(TypeError, match=r"^chunked_cross_entropy\(chunk_size=2\.5\): chunk_size must be an integer"):
        chunked_cross_entropy(hidden, weight, labels, chunk_size=2.5)
    with pytest.raises(ValueError, match=r"^chunked_cross_entropy\(reduction='none'\): reduction must be one of "
                                         r"'mean', 'sum'"):
        chunked_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(ValueError, match=r"^chunked_cross_entropy\(hidden \(13, 6\), weight \(11, 5\), labels "
                                         r"\(13,\)\): hidden must be \(N, H\) or \(B, L, H\) and weight \(V, H\)"):
        chunked_cross_entropy(hidden, weight[:, :5], labels)
    with pytest.raises(ValueError, match=r"labels \(12,\)\): labels must have the shape of hidden without its last "
                                         r"dimension, \(13,\)"):
        chunked_cross_entropy(hidden, weight, labels[:12])
    with pytest.raises(ValueError, match=r"bias \(10,\)\): bias must be \(V,\) = \(11,\)"):
        chunked_cross_entropy(hidden, weight, labels, bias=bias[:10])
    with pytest.raises(TypeError, match=r"^chunked_cross_entropy\(hidden torch\.float32, weight torch\.float64\): "
                                        r"hidden, weight and bias must share one floating dtype"):
        chunked_cross_entropy(hidden.float(), weight, labels)
    with pytest.raises(TypeError, match=r"^chunked_cross_entropy\(labels torch\.float32\): labels must be integer"):
        chunked_cross_entropy(hidden, weight, labels.float())
    bad = labels.clone()
    bad[5] = V
    with pytest.raises(ValueError, match=r"^chunked_cross_entropy\(labels\[5\]=11\): labels must be in \[0, 11\) "
                                         r"\(the vocabulary of weight\) or ignore_index=-100"):
        chunked_cross_entropy(hidden, weight, bad)
