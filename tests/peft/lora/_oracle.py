"""Hugging Face PEFT as the oracle for LoRA: tiny float64 versions of the custom models of PEFT's own
``tests/test_custom_models.py``, and one check that runs a PEFT ``LoraConfig`` on ours and on PEFT's and compares
everything a user sees.

``assert_equal_to_peft(model_id, peft_kwargs, tmp_path)``:

1. ``theirs = get_peft_model(base, LoraConfig(**kwargs))``; ``ours = inject_lora(base, config=LoRAConfig.from_peft(...))``;
   every adapter parameter gets random values on ours (so that nothing passes because ``B = 0``), copied to PEFT's
   parameter of the same name (``base_model.model.<our name>``, through ``rename`` where PEFT's in-memory name
   differs);
2. the same outputs, and the same outputs with the adapters disabled (both equal to the base);
3. merged: the same outputs and the same merged weights; unmerged: the outputs of step 2 again;
4. the files: PEFT loads ours and we load PEFT's, each with the saver's outputs;
5. one SGD step on a loss of the outputs: the same gradients and the same adapter after the step.

Everything is float64, so two implementations of the same math agree to ~1e-15; the tolerance is 1e-10 (a few
roundings of sums, which differ between kernels and CPUs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

peft = pytest.importorskip("peft")

from lightning_peft.peft import (
    LoRAConfig,
    disable_adapters,
    inject_lora,
    load_adapter,
    merge_lora,
    merged_state_dict,
    save_adapter,
    unmerge_lora,
)
from tests._models import conv1d

PREFIX = "base_model.model."
TOLERANCE = 1e-10


# ------------------------------------------------------------------------------------------------ the models
# Each takes a float64 batch from `inputs` and returns a float64 tensor; sizes are small but no dimension equals
# another, so a transposed factor cannot pass.


class MLP(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.lin0 = nn.Linear(10, 20, bias=bias)
        self.relu = nn.ReLU()
        self.lin1 = nn.Linear(20, 2, bias=bias)

    def forward(self, x: Tensor) -> Tensor:  # (B, 10) -> (B, 2)
        return self.lin1(self.relu(self.lin0(x)))


class EmbConv1D(nn.Module):
    """An embedding and a transformers ``Conv1D`` (weight (in, out)), as GPT-2 has."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 5)
        self.conv1d = conv1d(5, 7)
        self.lin0 = nn.Linear(7, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, T) ids -> (B, 2)
        return self.lin0(self.conv1d(self.emb(x)).tanh()).sum(1)


class ConvModel(nn.Module):
    """A convolution of ``dims`` spatial dimensions, flattened into ``lin0``."""

    def __init__(self, dims: int, kernel: int = 3, groups: int = 1, channels: tuple[int, int] = (2, 6)) -> None:
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        self.dims, self.channels = dims, channels
        setattr(self, f"conv{dims}d", conv(channels[0], channels[1], kernel, groups=groups))
        self.size = {1: 9, 2: 5, 3: 4}[dims]
        out = self.size - kernel + 1
        self.lin0 = nn.Linear(channels[1] * out**dims, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, C, *spatial) -> (B, 2)
        return self.lin0(getattr(self, f"conv{self.dims}d")(x).relu().flatten(1))


class MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.lin0 = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 8) -> (B, 2)
        return self.lin0(self.mha(x, x, x, need_weights=False)[0]).sum(1)


class MlpUsingParameters(nn.Module):
    """``lin0`` is a bare module whose forward reads its parameters directly (no ``nn.Linear``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Module()
        self.lin0.weight = nn.Parameter(torch.empty(20, 10))
        self.lin0.bias = nn.Parameter(torch.empty(20))
        nn.init.kaiming_uniform_(self.lin0.weight, a=5**0.5)
        nn.init.uniform_(self.lin0.bias, -0.3, 0.3)
        self.lin1 = nn.Linear(20, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, 10) -> (B, 2)
        return self.lin1(torch.nn.functional.linear(x, self.lin0.weight, self.lin0.bias).relu())


MODELS: dict[str, Callable[[], nn.Module]] = {
    "MLP": MLP,
    "EmbConv1D": EmbConv1D,
    "Conv1d": lambda: ConvModel(1),
    "Conv2d": lambda: ConvModel(2),
    "Conv2d1x1": lambda: ConvModel(2, kernel=1),
    "Conv2dGroups": lambda: ConvModel(2, groups=2, channels=(4, 6)),
    "Conv2dGroups2": lambda: ConvModel(2, groups=4, channels=(4, 8)),
    "Conv3d": lambda: ConvModel(3),
    "Conv3d1x1": lambda: ConvModel(3, kernel=1),
    "MHA": MHA,
    "MlpUsingParameters": MlpUsingParameters,
}


def inputs(model: nn.Module, batch: int = 3, seed: int = 0) -> Tensor:
    """A float64 (or id) batch for ``model``."""
    generator = torch.Generator().manual_seed(seed)
    if isinstance(model, EmbConv1D):
        return torch.randint(0, 100, (batch, 4), generator=generator)
    if isinstance(model, ConvModel):
        return torch.randn(batch, model.channels[0], *[model.size] * model.dims, generator=generator,
                           dtype=torch.float64)
    if isinstance(model, MHA):
        return torch.randn(batch, 4, 8, generator=generator, dtype=torch.float64)
    return torch.randn(batch, 10, generator=generator, dtype=torch.float64)


def base_model(model_id: str, seed: int = 0) -> nn.Module:
    """The model ``model_id`` of `MODELS` in float64, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return MODELS[model_id]().double().eval()


# ------------------------------------------------------------------------------------------------ the check


def close(a: Tensor, b: Tensor, what: str = "") -> None:
    torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda m: f"{what}: {m}")


def peft_name(name: str) -> str:
    """PEFT's in-memory name of our adapter parameter ``name``, where the two differ: PEFT keeps a DoRA magnitude
    in a module (``.weight``), and a saved module's trained copy under ``modules_to_save.<adapter>``."""
    if ".lora_magnitude_vector." in name:
        return f"{name}.weight"
    return name.replace(".trained_module.", ".modules_to_save.default.")


def adapted_pair(model_id: str, peft_kwargs: dict[str, Any], rename: Callable[[str], str] = peft_name,
                 seed: int = 0) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(ours, PEFT's, the base) for ``peft_kwargs``, with the same random adapter values on both."""
    base = base_model(model_id)
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**peft_kwargs)).eval()
    ours = copy.deepcopy(base)
    inject_lora(ours, config=LoRAConfig.from_peft(peft.LoraConfig(**peft_kwargs)))
    ours.eval()
    their_params = dict(theirs.named_parameters())
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in trainable(ours).items():
            key = PREFIX + rename(name)
            assert key in their_params, f"PEFT has no parameter {key}; its adapter parameters: {list(trainable(theirs))}"
            p.copy_(p + 0.3 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
            their_params[key].copy_(p)
    assert {PREFIX + rename(k) for k in trainable(ours)} == set(trainable(theirs)), "the adapter parameters differ"
    return ours, theirs, base


def trainable(model: nn.Module) -> dict[str, Tensor]:
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def _outputs(model: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        return model(x)


def _weights(model: nn.Module) -> dict[str, Tensor]:
    """A PEFT model's tensors by plain module names, as a merged export has them: a LoRA layer's base weight, a
    saved module's trained copy."""
    return {k.replace(".base_layer", "").replace(".modules_to_save.default", ""): v.clone()
            for k, v in model.state_dict().items()
            if "lora_" not in k and "token_adapter" not in k and ".original_module." not in k}


def assert_equal_to_peft(model_id: str, peft_kwargs: dict[str, Any], tmp_path: Path,
                         rename: Callable[[str], str] = peft_name, lr: float = 0.1) -> None:
    """Ours equals PEFT for ``peft_kwargs`` on model ``model_id``: forward, disable, merge, files, a training step.

    ``rename`` maps one of our adapter parameter names to PEFT's in-memory name (without ``base_model.model.``);
    a case with names of its own wraps `peft_name`.
    """
    ours, theirs, base = adapted_pair(model_id, peft_kwargs, rename)
    x = inputs(base)
    reference = _outputs(base, x)
    adapted = _outputs(ours, x)
    assert (adapted - reference).abs().max() > 1e-3, "the adapter does not change the output: nothing is compared"
    close(adapted, _outputs(theirs, x), "forward")

    with disable_adapters(ours), theirs.disable_adapter():
        close(_outputs(ours, x), reference, "disabled (ours)")
        close(_outputs(theirs, x), reference, "disabled (PEFT)")

    ours_merged = merged_state_dict(ours)  # our state dicts are taken unmerged: the merge is the export's
    merge_lora(ours)
    theirs.merge_adapter()
    close(_outputs(ours, x), adapted, "merged")
    theirs_merged = _weights(theirs.base_model.model)
    assert set(ours_merged) == set(theirs_merged), "the models' tensors differ"
    for key, value in theirs_merged.items():
        close(ours_merged[key], value, f"merged weight {key}")
    unmerge_lora(ours)
    theirs.unmerge_adapter()
    close(_outputs(ours, x), adapted, "unmerged")
    close(_outputs(theirs, x), adapted, "unmerged (PEFT)")

    save_adapter(ours, tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "ours").eval()
    close(_outputs(loaded, x), adapted, "PEFT loading our files")
    mine = load_adapter(copy.deepcopy(base), tmp_path / "theirs").eval()
    close(_outputs(mine, x), adapted, "our loading of PEFT's files")

    _one_step(ours, theirs, x, rename, lr)


def _one_step(ours: nn.Module, theirs: nn.Module, x: Tensor, rename: Callable[[str], str], lr: float) -> None:
    grads = []
    for model in (ours, theirs):
        model.train()
        optimizer = torch.optim.SGD(trainable(model).values(), lr=lr)
        torch.manual_seed(1)  # the same dropout masks
        y = model(x)
        (y.square().sum() + y.sum()).backward()
        grads.append({k: p.grad.clone() for k, p in trainable(model).items()})
        optimizer.step()
    for name, grad in grads[0].items():
        close(grad, grads[1][PREFIX + rename(name)], f"gradient of {name}")
    after = trainable(theirs)
    for name, p in trainable(ours).items():
        close(p, after[PREFIX + rename(name)], f"{name} after one step")
    assert any(g.abs().max() > 0 for g in grads[0].values()), "no adapter gradient: nothing is compared"
