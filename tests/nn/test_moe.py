"""MoE against a float64 loop over tokens, hand-computed auxiliary losses, and transformers' Mixtral block."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_peft.nn.moe import MoE
from lightning_peft.nn.transformer import FeedForward, TransformerBlock

_ACT = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def _expert(ff: FeedForward, h: torch.Tensor) -> torch.Tensor:
    """One expert on one token ``(H,)``, written out from its weights."""
    act = _ACT[ff.activation]
    up = F.linear(h, ff.up_proj.weight, ff.up_proj.bias)
    inner = act(F.linear(h, ff.gate_proj.weight, ff.gate_proj.bias)) * up if ff.gate_proj is not None else act(up)
    return F.linear(inner, ff.down_proj.weight, ff.down_proj.bias)


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE rule as a plain loop over tokens: top-k, renormalised gates, capacity by (rank, token) priority."""
    tokens = x.reshape(-1, moe.hidden_size)
    num_tokens, k, num_experts = tokens.shape[0], moe.top_k, moe.num_experts
    probs = (tokens @ moe.router.weight.T).softmax(-1)  # (T, E)
    choices, gates = [], []
    for t in range(num_tokens):
        chosen = sorted(range(num_experts), key=lambda e: (-probs[t, e].item(), e))[:k]
        p = torch.stack([probs[t, e] for e in chosen])
        choices.append(chosen)
        gates.append(p / p.sum() if moe.normalize_gates else p)
    capacity = math.inf if moe.dropless else math.ceil(moe.capacity_factor * num_tokens * k / num_experts)
    filled, kept = [0] * num_experts, set()
    for j in range(k):  # every first choice before any second choice, tokens in order within a rank
        for t in range(num_tokens):
            e = choices[t][j]
            if filled[e] < capacity:
                filled[e] += 1
                kept.add((t, j))
    rows = []
    for t in range(num_tokens):
        row = torch.zeros_like(tokens[t])
        for j in range(k):
            if (t, j) in kept:
                row = row + gates[t][j] * _expert(moe.experts[choices[t][j]], tokens[t])
        rows.append(row)
    return torch.stack(rows).reshape(x.shape)


def _grads(moe: MoE, x: torch.Tensor, fn, out_grad: torch.Tensor) -> dict[str, torch.Tensor]:
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    out.backward(out_grad)
    grads = {name: torch.zeros_like(p) if p.grad is None else p.grad.clone() for name, p in moe.named_parameters()}
    return {"out": out.detach(), "x": x.grad, **grads}


@pytest.mark.parametrize(
    ("top_k", "dropless", "capacity_factor", "activation", "gated", "bias"),
    [
        (1, False, 1.0, "silu", True, False),
        (2, False, 1.25, "silu", True, False),
        (2, True, 1.25, "silu", True, False),
        (2, False, 0.5, "gelu", False, True),
        (3, False, 1.0, "relu", True, True),
    ],
)
def test_output_and_gradients_match_a_float64_loop_over_tokens(top_k, dropless, capacity_factor, activation, gated,
                                                               bias):
    moe = MoE(8, 12, num_experts=4, top_k=top_k, capacity_factor=capacity_factor, dropless=dropless,
              activation=activation, gated=gated, bias=bias).double()
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    out_grad = torch.randn(2, 7, 8, dtype=torch.float64)
    ours = _grads(moe, x, moe, out_grad)
    stats = dict(moe.last_stats)
    expected = _grads(moe, x, lambda t: _reference(moe, t), out_grad)
    assert set(ours) == set(expected)
    assert len(ours) == 2 + 1 + 4 * (3 if gated else 2) * (2 if bias else 1)  # out, x, router, every expert weight
    for key in expected:
        torch.testing.assert_close(ours[key], expected[key], rtol=1e-10, atol=1e-12, msg=key)
    assert stats["tokens_per_expert"].dtype == torch.long and int(stats["tokens_per_expert"].sum()) <= 14 * top_k
    if dropless:
        assert stats["dropped_fraction"] == 0.0
    if capacity_factor == 0.5:
        assert stats["dropped_fraction"] >= 12 / 28  # capacity ceil(0.5 * 14 * 2 / 4) = 4: at most 16 of 28 kept
        assert int(stats["tokens_per_expert"].max()) <= 4


def _identity_router(moe: MoE) -> None:
    """Make the router logits equal the input (hidden_size == num_experts)."""
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(moe.num_experts, dtype=moe.router.weight.dtype))


def test_capacity_gives_first_choices_priority_over_second_choices_then_token_order():
    moe = MoE(3, 4, num_experts=3, top_k=2, capacity_factor=1.0).double()  # capacity ceil(1 * 3 * 2 / 3) = 2
    _identity_router(moe)
    # token 0 picks experts (2, 1); tokens 1 and 2 pick expert 1 first. Expert 1 is asked for 3 slots and has 2:
    # the two first choices win, token 0's second choice is dropped (token order alone would drop token 2's).
    x = torch.tensor([[0.0, 2.0, 3.0], [2.0, 3.0, 0.0], [0.0, 3.0, 2.0]], dtype=torch.float64)
    out = moe(x)
    assert moe.last_stats["tokens_per_expert"].tolist() == [1, 2, 2]
    assert moe.last_stats["dropped_fraction"] == pytest.approx(1 / 6)
    torch.testing.assert_close(moe.last_stats["load"], torch.tensor([1, 3, 2], dtype=torch.float64) / 6)
    p = x[0].softmax(-1)
    gate = p[2] / (p[2] + p[1])
    torch.testing.assert_close(out[0], gate * _expert(moe.experts[2], x[0]))  # only its first choice ran
    torch.testing.assert_close(out, _reference(moe, x))


def test_a_token_with_every_assignment_dropped_gets_zero_and_dropless_keeps_it():
    moe = MoE(3, 4, num_experts=3, top_k=1, capacity_factor=1.0).double()  # capacity ceil(4 / 3) = 2
    _identity_router(moe)
    x = torch.tensor([[5.0, 0, 0], [5.0, 0, 0], [5.0, 0, 0], [0, 5.0, 0]], dtype=torch.float64)  # 3 want expert 0
    out = moe(x)
    assert out[2].abs().max() == 0 and out[0].abs().max() > 0
    assert moe.last_stats["tokens_per_expert"].tolist() == [2, 1, 0]
    assert moe.last_stats["dropped_fraction"] == pytest.approx(0.25)
    block = TransformerBlock(3, num_heads=1, ffn_size=4, feed_forward=moe).double()  # pre-norm keeps the routing
    torch.testing.assert_close(block.feed_forward_sublayer(x.unsqueeze(0))[0, 2], x[2])  # the residual alone
    moe.dropless = True
    out_dropless = moe(x)
    assert moe.last_stats["tokens_per_expert"].tolist() == [3, 1, 0] and moe.last_stats["dropped_fraction"] == 0.0
    torch.testing.assert_close(out_dropless[:2], out[:2])
    torch.testing.assert_close(out_dropless[2], out_dropless[0])
    torch.testing.assert_close(out_dropless, _reference(moe, x))


def test_dropless_equals_a_capacity_that_never_binds():
    dropless = MoE(8, 12, num_experts=4, top_k=2, dropless=True)
    roomy = MoE(8, 12, num_experts=4, top_k=2, capacity_factor=2.0)  # 2.0 * T * 2 / 4 = T slots: nothing drops
    roomy.load_state_dict(dropless.state_dict())
    x = torch.randn(3, 10, 8)
    torch.testing.assert_close(roomy(x), dropless(x), rtol=0, atol=0)
    assert roomy.last_stats["dropped_fraction"] == 0.0
    tight = MoE(8, 12, num_experts=4, top_k=2, capacity_factor=0.25)
    tight.load_state_dict(dropless.state_dict())
    tight(x)
    assert tight.last_stats["dropped_fraction"] > 0.4


def test_aux_loss_equals_the_hand_computed_switch_and_z_loss():
    # Token e_j gives logits ln(3) at expert j and 0 elsewhere: p = 1/2 there and 1/6 at the three others.
    moe = MoE(4, 4, num_experts=4, top_k=1, aux_loss_coef=0.01, z_loss_coef=0.001).double()
    with torch.no_grad():
        moe.router.weight.copy_(math.log(3.0) * torch.eye(4, dtype=torch.float64))
    x = torch.eye(4, dtype=torch.float64)[[0, 0, 1, 2]]  # experts 0, 0, 1, 2 chosen: f = (1/2, 1/4, 1/4, 0)
    moe(x)
    # P = (1/3, 1/4, 1/4, 1/6); sum f P = 1/6 + 1/16 + 1/16 = 7/24; E * 7/24 = 7/6; logsumexp = ln 6 for every token.
    expected = 0.01 * 7 / 6 + 0.001 * math.log(6.0) ** 2
    assert moe.aux_loss.item() == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(moe.last_stats["load"], torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64))

    moe.aux_loss_coef, moe.z_loss_coef = 0.0, 1.0
    moe(x)
    assert moe.aux_loss.item() == pytest.approx(math.log(6.0) ** 2, rel=1e-12)
    uniform = MoE(4, 4, num_experts=4, top_k=1, aux_loss_coef=1.0, z_loss_coef=0.0).double()
    with torch.no_grad():
        uniform.router.weight.zero_()
    uniform(torch.randn(8, 4, dtype=torch.float64))  # p = 1/4 everywhere: E * sum f P = 4 * 1/4 = 1, the minimum
    assert uniform.aux_loss.item() == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_is_differentiable_and_its_router_gradient_matches_the_formula(top_k):
    moe = MoE(6, 8, num_experts=5, top_k=top_k, aux_loss_coef=0.3, z_loss_coef=0.05).double()
    x = torch.randn(11, 6, dtype=torch.float64)
    moe(x)
    moe.aux_loss.backward()
    weight = moe.router.weight.detach().clone().requires_grad_(True)
    logits = x @ weight.T
    probs = logits.softmax(-1)
    f = torch.zeros(5, dtype=torch.float64)
    for row in probs.detach():
        for e in row.topk(top_k).indices.tolist():
            f[e] += 1 / (11 * top_k)
    expected = 0.3 * 5 * (f * probs.mean(0)).sum() + 0.05 * torch.logsumexp(logits, -1).pow(2).mean()
    (grad,) = torch.autograd.grad(expected, weight)
    assert moe.aux_loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert moe.router.weight.grad.abs().max() > 0
    torch.testing.assert_close(moe.router.weight.grad, grad, rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in moe.experts.parameters())  # the aux loss does not touch the experts


def test_top1_switch_gate_is_the_raw_probability_unless_renormalised():
    switch = MoE(8, 12, num_experts=4, top_k=1, capacity_factor=4.0, normalize_gates=False).double()
    x = torch.randn(9, 8, dtype=torch.float64)
    out = switch(x)
    torch.testing.assert_close(out, _reference(switch, x))
    probs = (x @ switch.router.weight.T).softmax(-1)
    p, e = probs.max(-1)
    torch.testing.assert_close(out[0], p[0] * _expert(switch.experts[int(e[0])], x[0]))
    out.sum().backward()
    assert switch.router.weight.grad.abs().max() > 0  # the task loss trains the router

    renormalised = MoE(8, 12, num_experts=4, top_k=1, capacity_factor=4.0).double()
    renormalised.load_state_dict(switch.state_dict())
    out = renormalised(x)
    torch.testing.assert_close(out[0], _expert(renormalised.experts[int(e[0])], x[0]))  # gate 1
    out.sum().backward()
    assert renormalised.router.weight.grad.abs().max() < 1e-12  # documented: only the aux loss trains this router


def test_lora_on_the_experts_up_proj_trains_the_adapters_only():
    from lightning_peft.peft import inject_lora

    moe = MoE(8, 12, num_experts=4, top_k=2, dropless=True)
    x = torch.randn(4, 6, 8)
    before = moe(x).detach()
    layers = inject_lora(moe, rank=2, target_modules=["up_proj"])
    assert sorted(layers) == [f"experts.{e}.up_proj" for e in range(4)]
    torch.testing.assert_close(moe(x), before, rtol=0, atol=0)  # B starts at zero
    trainable = {name for name, p in moe.named_parameters() if p.requires_grad}
    assert trainable == {f"experts.{e}.up_proj.lora_{ab}.default.weight" for e in range(4) for ab in "AB"}
    optimizer = torch.optim.SGD([p for p in moe.parameters() if p.requires_grad], lr=0.5)
    loss = (moe(x) - 1.0).pow(2).mean()
    loss.backward()
    used = moe.last_stats["tokens_per_expert"]
    for e in range(4):
        grad = moe.experts[e].up_proj.lora_B["default"].weight.grad
        assert grad is not None and bool(grad.abs().max() > 0) == bool(used[e] > 0)
    assert all(p.grad is None for name, p in moe.named_parameters() if name not in trainable)
    optimizer.step()
    after = (moe(x) - 1.0).pow(2).mean()
    assert after < loss


def test_every_expert_gets_a_gradient_even_when_no_token_chose_it():
    moe = MoE(4, 6, num_experts=4, top_k=1, dropless=True)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 10.0  # x[0] > 0 sends every token to expert 0
    x = torch.rand(5, 4) + 0.1
    moe(x).sum().backward()
    assert moe.last_stats["tokens_per_expert"].tolist() == [5, 0, 0, 0]
    for e in (1, 2, 3):
        for p in moe.experts[e].parameters():
            assert p.grad is not None and p.grad.abs().max() == 0


def test_any_leading_shape_and_the_router_in_float32_under_bf16_autocast():
    moe = MoE(8, 12, num_experts=4)
    assert moe(torch.randn(5, 8)).shape == (5, 8)
    assert moe(torch.randn(2, 3, 4, 8)).shape == (2, 3, 4, 8)
    seen = []
    moe.router.register_forward_hook(lambda module, args, out: seen.append((args[0].dtype, out.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(torch.randn(2, 5, 8))
    assert seen[-1] == (torch.float32, torch.float32)
    assert out.dtype == torch.bfloat16 and moe.aux_loss.dtype == torch.float32
    half = MoE(8, 12, num_experts=4).to(torch.bfloat16)
    assert half(torch.randn(2, 5, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert half.aux_loss.dtype == torch.float32


def test_inside_a_transformer_block():
    moe = MoE(16, 24, num_experts=4, top_k=2)
    block = TransformerBlock(16, num_heads=4, ffn_size=32, feed_forward=moe)
    x = torch.randn(2, 5, 16, requires_grad=True)
    (block(x).sum() + moe.aux_loss).backward()
    assert x.grad is not None and moe.router.weight.grad.abs().max() > 0


def _mixtral(moe: MoE):
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from transformers import MixtralConfig

    config = MixtralConfig(
        hidden_size=moe.hidden_size, intermediate_size=moe.ffn_size, num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, hidden_act="silu", router_jitter_noise=0.0,
    )
    config._experts_implementation = "eager"
    block = modeling.MixtralSparseMoeBlock(config).to(moe.router.weight.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(moe.router.weight)
        for e, expert in enumerate(moe.experts):
            block.experts.gate_up_proj[e].copy_(torch.cat([expert.gate_proj.weight, expert.up_proj.weight]))
            block.experts.down_proj[e].copy_(expert.down_proj.weight)
    return block


@pytest.mark.parametrize("top_k", [1, 2])
def test_dropless_equals_transformers_mixtral_sparse_moe_block(top_k):
    moe = MoE(8, 12, num_experts=4, top_k=top_k, dropless=True)
    block = _mixtral(moe)
    x = torch.randn(3, 9, 8)
    out_grad = torch.randn(3, 9, 8)
    ours = _grads(moe, x, moe, out_grad)
    x_theirs = x.clone().requires_grad_(True)
    theirs = block(x_theirs)
    theirs.backward(out_grad)
    torch.testing.assert_close(ours["out"], theirs.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["x"], x_theirs.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["router.weight"], block.gate.weight.grad, rtol=1e-4, atol=1e-6)
    for e in range(4):
        gate_up = torch.cat([ours[f"experts.{e}.gate_proj.weight"], ours[f"experts.{e}.up_proj.weight"]])
        torch.testing.assert_close(gate_up, block.experts.gate_up_proj.grad[e], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours[f"experts.{e}.down_proj.weight"], block.experts.down_proj.grad[e],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2])
def test_balancing_term_is_transformers_mixtral_loss_divided_by_top_k(top_k):
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    moe = MoE(8, 12, num_experts=4, top_k=top_k, aux_loss_coef=1.0, z_loss_coef=0.0)
    x = torch.randn(3, 9, 8)
    moe(x)
    logits = moe.router_logits(x.reshape(-1, 8))
    theirs = modeling.load_balancing_loss_func((logits,), num_experts=4, top_k=top_k)
    # transformers' f_i is the share of *tokens* choosing expert i (sums to top_k), ours of assignments (sums to 1).
    torch.testing.assert_close(moe.aux_loss * top_k, theirs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"top_k": 0}, ValueError, r"MoE\(top_k=0\): top_k must be an integer in \[1, 4\] \(1: Switch"),
        ({"top_k": 5}, ValueError, r"MoE\(top_k=5\): top_k must be an integer in \[1, 4\]"),
        ({"top_k": 1.5}, TypeError, r"MoE\(top_k=1.5\): top_k must be an integer"),
        ({"capacity_factor": 0}, ValueError,
         r"MoE\(capacity_factor=0\): capacity_factor must be a finite number > 0.*dropless=True"),
        ({"capacity_factor": -1.0}, ValueError, r"MoE\(capacity_factor=-1.0\): capacity_factor must be a finite number > 0"),
        ({"capacity_factor": float("inf")}, ValueError,
         r"MoE\(capacity_factor=inf\): capacity_factor must be a finite number > 0"),
        ({"num_experts": 0}, ValueError, r"MoE\(num_experts=0\): num_experts must be an integer >= 1"),
        ({"aux_loss_coef": -0.1}, ValueError, r"MoE\(aux_loss_coef=-0.1\): aux_loss_coef must be a finite number >= 0"),
        ({"z_loss_coef": float("nan")}, ValueError, r"MoE\(z_loss_coef=nan\): z_loss_coef must be a finite number >= 0"),
        ({"activation": "tanh"}, ValueError, r"MoE\(activation='tanh'\): activation must be one of 'gelu'"),
    ],
)
def test_bad_settings_are_refused(kwargs, error, match):
    settings = {"hidden_size": 8, "ffn_size": 12, "num_experts": 4} | kwargs
    with pytest.raises(error, match=match):
        MoE(**settings)


def test_bad_inputs_are_refused_naming_the_layer():
    moe = MoE(8, 12, num_experts=4)
    with pytest.raises(ValueError, match=r"MoE: the input has shape \(2, 5, 6\) but hidden_size=8; give a "
                                         r"\(\.\.\., 8\)"):
        moe(torch.randn(2, 5, 6))
    moe.name = "layers.3.mlp"
    x = torch.randn(2, 5, 8)
    x[1, 2, 0] = float("nan")
    x[0, 0, 3] = float("inf")
    with pytest.raises(ValueError, match=r"MoE 'layers.3.mlp': the router logits are not finite \(NaN or inf\) "
                                         r"for 2 of 10 tokens"):
        moe(x)


@pytest.mark.slow
def test_bench_moe_quick_runs_and_reports_every_table(tmp_path):
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_moe.py"
    out, txt, plot = tmp_path / "moe.json", tmp_path / "moe.txt", tmp_path / "moe.png"
    result = subprocess.run(
        [sys.executable, str(script), "--quick", "--json", str(out), "--txt", str(txt), "--plot", str(plot)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert max(report["agreement"].values()) < 1e-4
    rows = report["rows"]
    assert {r["mode"] for r in rows} == {"forward", "forward+backward"}
    assert all(math.isfinite(r["speedup"]) and r["speedup"] > 0 for r in rows)
    assert {r["baseline"] for r in rows} >= {"mixtral", "every_expert", "dense"}
    scaling = report["scaling_rows"]
    assert [r["mode"] for r in scaling] == ["forward", "forward+backward"]
    assert all(r["slowest_over_fastest"] >= 1.0 for r in scaling)
    assert "| forward+backward" in txt.read_text() and plot.stat().st_size > 1000
