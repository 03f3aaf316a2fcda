"""ReversibleSequence against the same couplings under plain autograd, in float64 (and the saved-tensor count)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_peft.nn.reversible import ReversibleSequence
from lightning_peft.nn.transformer import TransformerBlock

D = 6  # half width


# ------------------------------------------------------------------------------------------------ references


def coupling(stack: ReversibleSequence, x: Tensor, **f_kwargs) -> Tensor:
    """The same network without reversibility: the coupling loop under plain autograd."""
    x1, x2 = x.chunk(2, dim=-1)
    for f, g in zip(stack.f_blocks, stack.g_blocks, strict=True):
        x1 = x1 + f(x2, **f_kwargs)
        x2 = x2 + g(x1)
    return torch.cat([x1, x2], dim=-1)


class Mlp(nn.Module):
    """A small branch with dropout inside (random in training) and an optional mask argument."""

    def __init__(self, width: int = D, dropout: float = 0.0) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        out = self.down(self.dropout(torch.tanh(self.up(x))))
        return out if mask is None else out * mask[..., None]


class AttentionF(nn.Module):
    """``F = block.attention_branch`` returning the tensor alone; the block is a submodule."""

    def __init__(self, block: TransformerBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor, **kwargs) -> Tensor:
        return self.block.attention_branch(x, **kwargs)[0]


class FeedForwardG(nn.Module):
    def __init__(self, block: TransformerBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        return self.block.feed_forward_branch(x)


def mlp_stack(layers: int, dropout: float = 0.0, seed: int = 0) -> ReversibleSequence:
    torch.manual_seed(seed)
    stack = ReversibleSequence([Mlp(dropout=dropout) for _ in range(layers)],
                               [Mlp(dropout=dropout) for _ in range(layers)])
    return stack.double()


def grads(stack: nn.Module, x: Tensor, run, seed: int = 1, **kwargs) -> tuple[Tensor, list[Tensor | None], Tensor]:
    """(output, [grad of x, grads of every parameter], a random number drawn after backward) for one run."""
    torch.manual_seed(seed)
    x = x.detach().requires_grad_(x.requires_grad)
    out = run(stack, x, **kwargs)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)  # a fixed output gradient
    (out * weight).sum().backward()
    result = [x.grad] + [p.grad for p in stack.parameters()]
    after = torch.rand(1)
    for p in stack.parameters():
        p.grad = None
    return out.detach(), result, after


def assert_same(reversible, plain) -> None:
    out_r, grads_r, after_r = reversible
    out_p, grads_p, after_p = plain
    torch.testing.assert_close(out_r, out_p)
    assert len(grads_r) == len(grads_p)
    for a, b in zip(grads_r, grads_p, strict=True):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(after_r, after_p)  # backward left the caller's random state as plain autograd does


def forward(stack, x, **kwargs):
    return stack(x, **kwargs)


# ------------------------------------------------------------------------------------------------ equality


def test_output_equals_the_plain_coupling_loop():
    stack = mlp_stack(3)
    x = torch.randn(2, 5, 2 * D, dtype=torch.float64)
    with torch.no_grad():
        expected = coupling(stack, x)
    for requires_grad in (False, True):  # the parameters require grad: the reversible function either way
        y = stack(x.requires_grad_(requires_grad))
        assert type(y.grad_fn).__name__ == "_ReversibleFunctionBackward"
        torch.testing.assert_close(y.detach(), expected, rtol=0, atol=0)
    stack.requires_grad_(False)
    y = stack(x.requires_grad_(False))  # nothing requires grad: the plain loop, no graph
    assert y.grad_fn is None
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_input_and_parameter_gradients_equal_plain_autograd_with_a_shared_block():
    torch.manual_seed(0)
    shared = Mlp().double()
    stack = ReversibleSequence([Mlp().double(), shared, Mlp().double(), shared],
                               [Mlp().double() for _ in range(4)])
    x = torch.randn(3, 4, 2 * D, dtype=torch.float64, requires_grad=True)
    assert_same(grads(stack, x, forward), grads(stack, x, coupling))  # the shared block: the sum of its two uses


def test_dropout_inside_f_and_g_is_replayed_exactly():
    stack = mlp_stack(4, dropout=0.5).train()
    x = torch.randn(2, 7, 2 * D, dtype=torch.float64, requires_grad=True)
    reversible, plain = grads(stack, x, forward), grads(stack, x, coupling)
    assert_same(reversible, plain)
    other = grads(stack, x, forward, seed=2)
    assert not torch.equal(other[0], reversible[0])  # dropout is on: another seed gives another output


def test_keyword_arguments_reach_every_f():
    stack = mlp_stack(3)
    x = torch.randn(2, 5, 2 * D, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    with_mask = grads(stack, x, forward, mask=mask)
    assert_same(with_mask, grads(stack, x, coupling, mask=mask))
    assert not torch.equal(with_mask[0], grads(stack, x, forward)[0])


def test_frozen_parameters_with_a_few_trainable_and_an_input_without_grad():
    stack = mlp_stack(3)
    stack.requires_grad_(False)
    trainable = [stack.f_blocks[1].up.bias, stack.g_blocks[2].down.weight, stack.g_blocks[0].up.weight]
    for p in trainable:
        p.requires_grad_(True)
    x = torch.randn(2, 5, 2 * D, dtype=torch.float64)  # as from a frozen embedding
    y = stack(x)
    assert type(y.grad_fn).__name__ == "_ReversibleFunctionBackward"
    reversible, plain = grads(stack, x, forward), grads(stack, x, coupling)
    assert_same(reversible, plain)
    assert reversible[1][0] is None  # no gradient for the input
    assert sum(g is not None for g in reversible[1]) == len(trainable)


@pytest.mark.parametrize("layout", ["bert_prenorm", "llama"])
def test_transformer_block_branches_as_f_and_g(layout):
    torch.manual_seed(0)
    options = ({"norm": "layernorm", "activation": "gelu", "attention_dropout": 0.2}
               if layout == "bert_prenorm" else
               {"norm": "rmsnorm", "activation": "silu", "gated": True, "causal": True, "rotary": True,
                "num_kv_heads": 1, "bias": False})
    blocks = [TransformerBlock(8, num_heads=2, ffn_size=16, norm_first=True, **options).double() for _ in range(3)]
    stack = ReversibleSequence([AttentionF(b) for b in blocks], [FeedForwardG(b) for b in blocks]).train()
    h = torch.randn(2, 5, 8, dtype=torch.float64)
    x = torch.cat([h, h], dim=-1).requires_grad_()  # (B, L, 2H)
    mask = torch.tensor([[True, True, True, False, False], [True] * 5])
    reversible = grads(stack, x, forward, key_padding_mask=mask)
    assert_same(reversible, grads(stack, x, coupling, key_padding_mask=mask))
    assert all(g is not None for g in reversible[1])  # the input and every parameter of the three blocks


def test_float32_gradients_agree_with_plain_autograd():
    torch.manual_seed(0)
    stack = ReversibleSequence([Mlp() for _ in range(8)], [Mlp() for _ in range(8)])
    x = torch.randn(4, 6, 2 * D, requires_grad=True)
    (out_r, grads_r, _), (out_p, grads_p, _) = grads(stack, x, forward), grads(stack, x, coupling)
    torch.testing.assert_close(out_r, out_p, rtol=0, atol=0)
    for a, b in zip(grads_r, grads_p, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_autocast_state_is_replayed_in_backward():
    torch.manual_seed(0)
    stack = ReversibleSequence([Mlp() for _ in range(3)], [Mlp() for _ in range(3)])
    x = torch.randn(4, 6, 2 * D, requires_grad=True)

    def under_autocast(run):
        def wrapped(stack, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return run(stack, x)
        return wrapped

    (out_r, grads_r, _) = grads(stack, x, under_autocast(forward))
    (out_p, grads_p, _) = grads(stack, x, under_autocast(coupling))
    (_, grads_fp32, _) = grads(stack, x, coupling)
    torch.testing.assert_close(out_r, out_p, rtol=0, atol=0)
    for a, b, c in zip(grads_r, grads_p, grads_fp32, strict=True):
        assert (a - b).abs().max() < 0.1 * (b - c).abs().max()  # far closer to bf16 autograd than to fp32


# ------------------------------------------------------------------------------------------------ no grad, memory


def test_no_grad_and_inference_run_the_plain_loop_and_save_nothing():
    stack = mlp_stack(3, dropout=0.5).eval()
    x = torch.randn(2, 5, 2 * D, dtype=torch.float64, requires_grad=True)
    expected = coupling(stack, x).detach()
    for context in (torch.no_grad, torch.inference_mode):
        packed = []
        with context(), torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            y = stack(x)
        assert y.grad_fn is None and packed == []
        torch.testing.assert_close(y, expected, rtol=0, atol=0)  # eval: dropout off
    y = stack(x)  # eval mode with grad enabled: the reversible function, the same numbers
    assert type(y.grad_fn).__name__ == "_ReversibleFunctionBackward"
    torch.testing.assert_close(y.detach(), expected, rtol=0, atol=0)


def saved_for_backward(stack: ReversibleSequence, run, x: Tensor) -> tuple[int, int]:
    """(tensors, elements) saved for backward by one forward: what the graph keeps alive until backward."""
    sizes: list[int] = []

    def pack(t: Tensor) -> Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(stack, x)
    return len(sizes), sum(sizes)


def test_saved_activations_do_not_grow_with_depth():
    x = torch.randn(2, 16, 2 * D, dtype=torch.float64, requires_grad=True)
    shallow, deep = mlp_stack(2), mlp_stack(8)
    assert saved_for_backward(shallow, forward, x) == saved_for_backward(deep, forward, x) == (1, x.numel())
    plain_shallow, plain_deep = saved_for_backward(shallow, coupling, x), saved_for_backward(deep, coupling, x)
    assert plain_deep[1] > 3.5 * plain_shallow[1] > 0  # plain autograd keeps every layer's activations


# ------------------------------------------------------------------------------------------------ errors


def test_errors_of_the_constructor():
    with pytest.raises(ValueError, match=r"got 2 f_blocks and 1 g_blocks; give one F and one G per layer"):
        ReversibleSequence([Mlp(), Mlp()], [Mlp()])
    with pytest.raises(ValueError, match=r"got 0 f_blocks and 0 g_blocks.*at least one layer"):
        ReversibleSequence([], [])
    block = TransformerBlock(8, num_heads=2, ffn_size=16)
    with pytest.raises(TypeError, match=r"g_blocks\[0\] is a method, not an nn.Module; wrap a function"):
        ReversibleSequence([AttentionF(block)], [block.feed_forward_branch])


def test_errors_of_the_forward():
    stack = mlp_stack(2)
    with pytest.raises(ValueError, match=r"the input has shape \(2, 7\); its last dimension must be even"):
        stack(torch.randn(2, 7, dtype=torch.float64))
    mask = torch.ones(2, 5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"keyword argument 'mask' requires grad, but keyword arguments of F are not"):
        stack(torch.randn(2, 5, 2 * D, dtype=torch.float64), mask=mask)

    narrow = ReversibleSequence([Mlp(), nn.Linear(D, D - 1)], [Mlp(), Mlp()])
    for requires_grad in (False, True):
        x = torch.randn(2, 3, 2 * D, requires_grad=requires_grad)
        with pytest.raises(ValueError, match=r"f_blocks\[1\] \(Linear\) maps shape \(2, 3, 6\) to \(2, 3, 5\); each"):
            narrow(x)

    block = TransformerBlock(4, num_heads=2, ffn_size=8)
    tupled = ReversibleSequence([lambda_module(block.attention_branch)], [FeedForwardG(block)])
    with pytest.raises(TypeError, match=r"f_blocks\[0\] \(Call\) returned a tuple; each block must return one"):
        tupled(torch.randn(1, 3, 8))


def lambda_module(fn) -> nn.Module:
    class Call(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return fn(x)

    return Call()


def test_a_parameter_not_registered_in_its_block_is_refused_in_backward():
    class Unregistered(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            object.__setattr__(self, "inner", inner)  # held, not registered: block.parameters() misses it

        def forward(self, x: Tensor) -> Tensor:
            return self.inner(x)

    stack = ReversibleSequence([Mlp()], [Unregistered(nn.Linear(D, D))])
    y = stack(torch.randn(2, 2 * D, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"g_blocks\[0\] used 2 tensor\(s\) requiring grad that are not parameters"):
        y.sum().backward()


def test_double_backward_is_refused():
    stack = mlp_stack(2)
    x = torch.randn(2, 2 * D, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(stack(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()
