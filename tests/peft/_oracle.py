"""Hugging Face PEFT as the oracle, for any method: tiny float64 versions of the custom models of PEFT's own
``tests/test_custom_models.py``, and one check that runs a PEFT config on ours and on PEFT's and compares everything a
user sees. A method is described once by a `Method` (its PEFT config class, our inject function, its switches);
``tests/peft/<method>/_oracle.py`` holds each method's (LoRA's, IA³'s).

``assert_equal_to_peft(model_id, peft_kwargs, tmp_path, method)``:

1. ``theirs = get_peft_model(base, method.config(**kwargs))``; ``ours = method.inject(base, method.config(**kwargs))``;
   every adapter parameter gets random values on ours (so that nothing passes because ``B = 0`` or ``l = 1``), copied
   to PEFT's parameter of the same name (``base_model.model.<our name>``, through ``method.rename`` where PEFT's
   in-memory name differs);
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

peft = pytest.importorskip("peft")

from lightning_peft.peft import load_adapter, merged_state_dict, save_adapter
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


class MLP2(nn.Module):
    """PEFT's ``MLP2``: 10 -> 32 -> 2 (a 32-wide input for BOFT's butterfly rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(10, 32)
        self.lin1 = nn.Linear(32, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, 10) -> (B, 2)
        return self.lin1(self.lin0(x).relu())


class Conv2d2(nn.Module):
    """PEFT's ``ModelConv2D2``: a linear layer into a 3x3 image of 8 channels, ``Conv2d(8, 32, 3)`` (72 rotated
    features). PEFT's reshapes its 40 features across samples; here each sample has its own 72."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(10, 72)
        self.conv2d = nn.Conv2d(8, 32, 3)
        self.lin1 = nn.Linear(32, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, 10) -> (B, 2)
        image = self.lin0(x).relu().reshape(-1, 8, 3, 3)  # (B, 8, 3, 3)
        return self.lin1(self.conv2d(image).relu().flatten(1))


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

    def __init__(self, dims: int, kernel: int = 3, groups: int = 1, channels: tuple[int, int] = (2, 6),
                 size: int | None = None) -> None:
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        self.dims, self.channels = dims, channels
        setattr(self, f"conv{dims}d", conv(channels[0], channels[1], kernel, groups=groups))
        self.size = size or {1: 9, 2: 5, 3: 4}[dims]
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


class LinearUsingParameter(nn.Module):
    """PEFT's ``_LinearUsingParameter``: a linear layer whose own forward reads its parameters (weight (in, out))."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) / in_features**0.5)
        self.bias = nn.Parameter(torch.rand(out_features) - 0.5)

    def forward(self, x: Tensor) -> Tensor:  # (B, in) -> (B, out)
        return x @ self.weight + self.bias


class MlpUsingParameters(nn.Module):
    """PEFT's model of that name: layers without ``nn.Linear``, reached only through ``target_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0 = LinearUsingParameter(10, 20)
        self.lin1 = LinearUsingParameter(20, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, 10) -> (B, 2)
        return self.lin1(self.lin0(x).relu())


class MoE(nn.Module):
    """A one-layer transformers 5 mixture-of-experts model (``"mixtral"``: experts (E, out, in); ``"gpt_oss"``:
    (E, in, out), ``is_transposed``) built from a config, fed ``(B, 10)`` through a linear embedding of 2 tokens."""

    def __init__(self, kind: str, experts: str = "eager", intermediate: int = 6) -> None:
        super().__init__()
        import transformers

        config_type, model_type = {"mixtral": ("MixtralConfig", "MixtralModel"),
                                   "gpt_oss": ("GptOssConfig", "GptOssModel")}[kind]
        config = getattr(transformers, config_type)(
            vocab_size=4, hidden_size=8, intermediate_size=intermediate, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=4, num_local_experts=3, num_experts_per_tok=2,
            **({"layer_types": ["full_attention"]} if kind == "gpt_oss" else {}))
        config._experts_implementation = experts  # "grouped_mm", the default, has no float64 kernel
        self.embed = nn.Linear(10, 16)
        self.model = getattr(transformers, model_type)(config)

    def forward(self, x: Tensor) -> Tensor:  # (B, 10) -> (B, 2, 8)
        return self.model(inputs_embeds=self.embed(x).view(x.shape[0], 2, 8)).last_hidden_state


MODELS: dict[str, Callable[[], nn.Module]] = {
    "MLP": MLP,
    "MLP2": MLP2,
    "Conv2d2": Conv2d2,
    "EmbConv1D": EmbConv1D,
    "Conv1d": lambda: ConvModel(1),
    "Conv1dGroups": lambda: ConvModel(1, groups=2, channels=(4, 6)),
    "Conv1dBigger": lambda: ConvModel(1, kernel=2, channels=(12, 5)),
    "Conv2d": lambda: ConvModel(2),
    "Conv2d1x1": lambda: ConvModel(2, kernel=1),
    "Conv2dGroups": lambda: ConvModel(2, groups=2, channels=(4, 6)),
    "Conv2dGroups2": lambda: ConvModel(2, groups=4, channels=(4, 8)),
    "Conv3d": lambda: ConvModel(3),
    # PEFT's own "Conv2d" (5 -> 10 channels, 3x3 kernel, a 3x3 input: one patch per image), which its OFT rows
    # size r for (5 * 3 * 3 = 45 rotated features)
    "Conv2dPEFT": lambda: ConvModel(2, channels=(5, 10), size=3),
    "Conv2dPEFT5x5": lambda: ConvModel(2, channels=(5, 10)),  # the same on a 5x5 input: patches overlap
    "Conv3d1x1": lambda: ConvModel(3, kernel=1),
    "MHA": MHA,
    "MlpUsingParameters": MlpUsingParameters,
    "Mixtral": lambda: MoE("mixtral"),
    "GptOss": lambda: MoE("gpt_oss"),
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


def close(a: Tensor, b: Tensor, what: str = "", tolerance: float = TOLERANCE) -> None:
    torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance, msg=lambda m: f"{what}: {m}")


@dataclass(frozen=True)
class Method:
    """One PEFT method as the check drives it, on PEFT's side and on ours.

    Attributes:
        config: PEFT's config class (``peft.LoraConfig``).
        inject: Ours: ``inject(model, peft_config)`` adapts ``model`` as the PEFT config object says.
        disable: Ours: a context manager ``disable(model)`` in which the model computes the base output.
        merge: Ours, in place: ``merge(model)``; ``unmerge(model)`` undoes it.
        rename: PEFT's in-memory name (without ``base_model.model.``) of one of our adapter parameter names.
        markers: Substrings of the names of PEFT's adapter tensors (left out of its merged weights).
        peft_cannot_merge: ``{model_id: what PEFT's merge raises}``; those models run ``merge_without_peft``
            ``(model_id, ours, theirs, base, x, adapted)`` instead of the comparison of merges.
        peft_unmerge_tolerance: How close PEFT's own unmerge comes back (IA³'s divides by ``l + 1e-8``).
        peft_wrong_gradients: ``(peft_kwargs) -> suffixes`` of our parameter names whose gradient PEFT computes wrong
            for those kwargs (a bug of its own backward); those gradients and steps are left out of the comparison
            and checked against autograd in the method's own tests.
        fix_peft: Corrects a quirk of PEFT's model in place before the comparison (AdaLoRA's ``ranknum``, left
            trainable on a float64 model); None: none.
        least_change: How far the adapted outputs must be from the base's for a row to compare anything.
    """

    config: type
    inject: Callable[[nn.Module, Any], object]
    disable: Callable[[nn.Module], Any]
    merge: Callable[[nn.Module], object]
    unmerge: Callable[[nn.Module], object]
    rename: Callable[[str], str]
    markers: tuple[str, ...]
    peft_cannot_merge: dict[str, type] = field(default_factory=dict)
    merge_without_peft: Callable[..., None] | None = None
    peft_unmerge_tolerance: float = TOLERANCE
    peft_wrong_gradients: Callable[[dict[str, Any]], tuple[str, ...]] = lambda kwargs: ()
    fix_peft: Callable[[nn.Module], None] | None = None
    least_change: float = 1e-3


def adapted_pair(model_id: str, peft_kwargs: dict[str, Any], method: Method, rename: Callable[[str], str] | None = None,
                 seed: int = 0) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(ours, PEFT's, the base) for ``peft_kwargs``, with the same random adapter values on both."""
    rename = rename or method.rename
    base = base_model(model_id)
    theirs = peft.get_peft_model(copy.deepcopy(base), method.config(**peft_kwargs)).eval()
    if method.fix_peft is not None:
        method.fix_peft(theirs)
    ours = copy.deepcopy(base)
    method.inject(ours, method.config(**peft_kwargs))
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


def outputs(model: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        return model(x)


def peft_weights(model: nn.Module, markers: tuple[str, ...]) -> dict[str, Tensor]:
    """A PEFT model's tensors by plain module names, as a merged export has them: an adapted layer's base weight, a
    saved module's trained copy, a trainable-tokens embedding's weight (holding the rows once merged)."""
    return {k.replace(".token_adapter.base_layer", "").replace(".base_layer", "").replace(".modules_to_save.default", "")
            : v.clone() for k, v in model.state_dict().items()
            if not any(m in k for m in markers) and ".original_module." not in k}


def assert_equal_to_peft(model_id: str, peft_kwargs: dict[str, Any], tmp_path: Path, method: Method,
                         rename: Callable[[str], str] | None = None, lr: float = 0.1) -> None:
    """Ours equals PEFT for ``peft_kwargs`` of ``method`` on model ``model_id``: forward, disable, merge, files, a
    training step. ``rename``: instead of ``method.rename``, for a case with names of its own."""
    rename = rename or method.rename
    ours, theirs, base = adapted_pair(model_id, peft_kwargs, method, rename)
    x = inputs(base)
    reference = outputs(base, x)
    adapted = outputs(ours, x)
    assert (adapted - reference).abs().max() > method.least_change, "the adapter does not change the output: nothing is compared"
    close(adapted, outputs(theirs, x), "forward")

    with method.disable(ours), theirs.disable_adapter():
        close(outputs(ours, x), reference, "disabled (ours)")
        close(outputs(theirs, x), reference, "disabled (PEFT)")

    if model_id in method.peft_cannot_merge:
        with pytest.raises(method.peft_cannot_merge[model_id]):
            theirs.merge_adapter()
        method.merge_without_peft(model_id, ours, theirs, base, x, adapted)
    else:
        ours_merged = merged_state_dict(ours)  # our state dicts are taken unmerged: the merge is the export's
        method.merge(ours)
        theirs.merge_adapter()
        close(outputs(ours, x), adapted, "merged")
        theirs_merged = peft_weights(theirs.base_model.model, method.markers)
        assert set(ours_merged) == set(theirs_merged), "the models' tensors differ"
        for key, value in theirs_merged.items():
            close(ours_merged[key], value, f"merged weight {key}")
        method.unmerge(ours)
        theirs.unmerge_adapter()
        close(outputs(ours, x), adapted, "unmerged")
        close(outputs(theirs, x), adapted, "unmerged (PEFT)", method.peft_unmerge_tolerance)

    save_adapter(ours, tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "ours").eval()
    close(outputs(loaded, x), adapted, "PEFT loading our files")
    mine = load_adapter(copy.deepcopy(base), tmp_path / "theirs").eval()
    close(outputs(mine, x), adapted, "our loading of PEFT's files")

    if method.peft_unmerge_tolerance > TOLERANCE:  # PEFT's base weights are off by its unmerge: a fresh copy trains
        theirs = adapted_pair(model_id, peft_kwargs, method, rename)[1]
    one_step(ours, theirs, x, rename, lr, method.peft_wrong_gradients(peft_kwargs))


def one_step(ours: nn.Module, theirs: nn.Module, x: Tensor, rename: Callable[[str], str], lr: float,
             wrong: tuple[str, ...] = ()) -> None:
    grads = []
    for model in (ours, theirs):
        model.train()
        optimizer = torch.optim.SGD(trainable(model).values(), lr=lr)
        torch.manual_seed(1)  # the same dropout masks
        y = model(x)
        (y.square().sum() + y.sum()).backward()
        grads.append({k: p.grad.clone() for k, p in trainable(model).items()})
        optimizer.step()
    compared = [name for name in grads[0] if not name.endswith(wrong)] if wrong else list(grads[0])
    for name in compared:
        close(grads[0][name], grads[1][PREFIX + rename(name)], f"gradient of {name}")
    after, mine = trainable(theirs), trainable(ours)
    for name in compared:
        close(mine[name], after[PREFIX + rename(name)], f"{name} after one step")
    assert any(g.abs().max() > 0 for g in grads[0].values()), "no adapter gradient: nothing is compared"
