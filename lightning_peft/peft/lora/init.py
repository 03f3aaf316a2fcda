r"""LoRA starts that read the base weight and rewrite it (``init="pissa"``, ``"pissa_niter_K"``, ``"olora"``,
``"loftq"``), as Hugging Face PEFT's ``init_lora_weights`` of the same names.

PiSSA: Meng et al., "PiSSA: Principal Singular Values and Singular Vectors Adaptation of Large Language Models",
arXiv:2404.02948. OLoRA: Büyükakyüz, "OLoRA: Orthonormal Low-Rank Adaptation of Large Language Models",
arXiv:2406.01775. LoftQ: Li et al., "LoftQ: LoRA-Fine-Tuning-Aware Quantization for Large Language Models",
arXiv:2310.08659.

Update rules for a base weight ``W`` (out, in), rank ``r``, scale ``s`` (computed in float32, or float64 for a float64
base; ``A`` is (r, in), ``B`` (out, r)):

```text
pissa          W = U diag(S) V^T (SVD)      B = U_r diag(sqrt(S_r / s))   A = diag(sqrt(S_r / s)) V_r^T
pissa_niter_K  U_r, S_r, V_r = torch.svd_lowrank(W, r, niter=K)   (randomised: drawn with the seed `SEED`)
olora          W = Q R (reduced QR)         B = Q[:, :r]                  A = R[:r]
all three      W_res = W - s B A            the base becomes W_res, so the model starts equal to the base
loftq          T = iterations (1: PEFT's default); L_0 R_0 = 0; for t = 1..T:
                   Q_t = dequant(quant(W - L_{t-1} R_{t-1}));  L_t R_t = rank-r SVD of W - Q_t (as PiSSA's B, A, s=1)
               base = quant(W - L_{T-1} R_{T-1}) (it dequantizes to Q_T);  B = L_T / sqrt(s), A = R_T / sqrt(s)
```

LoftQ quantizes with the model's own ``quantize`` method (``"nf4"``: torchao's NF4, `lightning_peft.peft.quantize`),
so the quantized base the algorithm corrects is the one the model trains on. PEFT's LoftQ puts ``B = L_T``, ``A =
R_T`` whatever the scale (peft#1982), so its model starts at ``Q_T + s L_T R_T``; both agree when ``alpha == rank``.

The base no longer holds ``W``, so an adapter file of the trained ``A``, ``B`` means nothing on the original base. The
first factors ``A_0``, ``B_0`` are kept (``layer.initial_factors``) for PEFT's conversion on save
(``save_adapter(..., convert_to_lora=True)``): ``W + s (B A - B_0 A_0) = W_res + s B A``, so

```text
A' = [A; A_0] (2r, in)    B' = [B, -B_0] (out, 2r)    alpha' = 2 alpha (sqrt(2) alpha with rsLoRA): s' = s
```

is a plain LoRA of rank ``2r`` on the original base. LoftQ's trained model ``Q_T + s B A`` differs from ``W`` by more
than a low-rank term: only its merged export represents it.

A resume rebuilds the rewritten base (and ``A_0``, ``B_0``) by running the start again on the original base, so each
start is a function of that weight alone: ``pissa_niter_K`` draws its random projection from a fork of the weight's
device generator seeded `SEED`: PEFT after ``torch.manual_seed(SEED)`` on each layer (PEFT draws from the global
generator, so its unseeded resume builds another base; recording the start in checkpoints instead would double an
adapter-only checkpoint and leave PEFT-format loads with the problem).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from .._common import dense_weight, is_quantized
from ..quantize import quantized, why_not

PLAIN = ("kaiming", "gaussian")
_FORMS = re.compile(r"pissa|pissa_niter_(\d+)|olora|loftq|loftq_iter_([1-9]\d*)")
# Hugging Face PEFT starts that need more than the base weight: a data pass (EVA, CorDA) or another method's state.
_DATA_STARTS = ("eva", "corda", "lora_ga")
SEED = 0  # pissa_niter_K's random projection: a fixed draw, so that every run starts alike


def check_init(value: object, who: str = "LoRA") -> str:
    """``value`` if it names a start lightning-peft implements; else the error saying which do."""
    if not isinstance(value, str):
        raise TypeError(f"{who}(init={value!r}): give a string, e.g. 'kaiming', 'gaussian' or 'pissa'.")
    if value in PLAIN or _FORMS.fullmatch(value):
        return value
    why = (" It needs a pass over training data before training (activation statistics), which lightning-peft "
           "does not implement; use Hugging Face PEFT for it, or 'pissa'/'olora', which need the weights only."
           if value.lower().startswith(_DATA_STARTS) else "")
    raise ValueError(f"{who}(init={value!r}): init must be one of 'kaiming', 'gaussian', 'pissa', 'pissa_niter_K' "
                     f"(K >= 0), 'olora', 'loftq' or 'loftq_iter_K' (K >= 1).{why}")


def rewrites_base(init: str) -> bool:
    return init not in PLAIN


class Start:
    """A recorded ``init`` as a resume compares it (`LoRAAdapter.resume_fields`): kaiming and gaussian may follow each
    other; a start that rewrote the base may not change, since the resume rebuilds that base by running it again."""

    def __init__(self, init: str) -> None:
        self.init, self.key = init, (init if rewrites_base(init) else PLAIN)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Start) and self.key == other.key

    def __repr__(self) -> str:
        return f"{self.init!r} " + ("(a start that rewrote the base weights: resuming rebuilds them by running that same "
                                    "start on the original base, so another init would put the trained factors on "
                                    "another base)" if self.key == self.init else "(a start that keeps the base weights)")


def loftq_iterations(init: str) -> int | None:
    """LoftQ's number of alternating steps for ``init``, None for another start."""
    if not init.startswith("loftq"):
        return None
    return int(init.rpartition("_")[2]) if "_iter_" in init else 1


def _split(u: Tensor, s: Tensor, vh: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """``(A, B)`` from a rank-r SVD ``u`` (out, r), ``s`` (r,), ``vh`` (r, in): ``s * B @ A = u diag(s) vh``."""
    root = torch.diag(torch.sqrt(s / scaling))  # (r, r)
    return root @ vh, u @ root


def pissa(weight: Tensor, rank: int, scaling: float, niter: int | None = None) -> tuple[Tensor, Tensor]:
    """PiSSA's ``(A, B)`` of ``weight`` (out, in): the principal ``rank`` singular triplets, split evenly."""
    if niter is None:
        u, s, vh = torch.linalg.svd(weight, full_matrices=False)
        return _split(u[:, :rank], s[:rank], vh[:rank], scaling)
    with seeded(weight.device):
        u, s, v = torch.svd_lowrank(weight, rank, niter=niter)
    return _split(u, s, v.t(), scaling)


@contextlib.contextmanager
def seeded(device: torch.device) -> Iterator[None]:
    """Inside: the global generator of ``device`` (where ``svd_lowrank`` draws) seeded with `SEED`; after: every
    generator as it was."""
    cpu = device.type == "cpu"
    with torch.random.fork_rng(devices=[] if cpu else [device], device_type=None if cpu else device.type):
        if cpu:
            torch.random.default_generator.manual_seed(SEED)
        else:
            module = torch.get_device_module(device.type)
            index = module.current_device() if device.index is None else device.index
            module.default_generators[index].manual_seed(SEED)
        yield


def olora(weight: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """OLoRA's ``(A, B)`` of ``weight`` (out, in): ``R[:r]`` and the orthonormal ``Q[:, :r]``."""
    q, r = torch.linalg.qr(weight)  # (out, k), (k, in)
    return r[:rank].contiguous(), q[:, :rank].contiguous()


def loftq(weight: Tensor, rank: int, scaling: float, iterations: int,
          round_trip: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """LoftQ's ``(A, B, base)`` of ``weight`` (out, in): ``base`` is what the quantizer gets (its ``round_trip``
    values are the quantized base the factors correct)."""
    low_rank = torch.zeros_like(weight)  # L_{t-1} R_{t-1}
    for _ in range(iterations):
        base = weight - low_rank
        u, s, vh = torch.linalg.svd(weight - round_trip(base), full_matrices=False)
        a, b = _split(u[:, :rank], s[:rank], vh[:rank], 1.0)
        low_rank = b @ a
    root = math.sqrt(scaling)
    return a / root, b / root, base


def initialise(layer: nn.Module, name: str, init: str, round_trip: Callable[[Tensor], Tensor] | None = None) -> None:
    """Start adapter ``name`` of ``layer`` (a ``LoRALinear``) with ``init`` and rewrite its base weight: the residual
    (PiSSA, OLoRA) or LoftQ's input to the quantizer (``round_trip``: quantize and dequantize it)."""
    base, spec = layer.base_layer, layer.specs[name]
    lora_a, lora_b = layer.factors(name)
    original = base.weight
    dtype = torch.promote_types(original.dtype, torch.float32)
    weight = original.detach().to(dtype)
    weight = weight.t() if layer.fan_in_fan_out else weight  # (out, in)
    if init.startswith("pissa"):
        niter = init.rpartition("_")[2] if "_niter_" in init else None
        a, b = pissa(weight, spec.rank, spec.scaling, None if niter is None else int(niter))
    elif init == "olora":
        a, b = olora(weight, spec.rank)
    else:
        a, b, weight = loftq(weight, spec.rank, spec.scaling, loftq_iterations(init),
                             lambda w: round_trip(w.to(original.dtype)).to(dtype))
    with torch.no_grad():
        lora_a.copy_(a)
        lora_b.copy_(b)
        if init.startswith("loftq"):
            new = weight
        else:
            new = weight - spec.scaling * b @ a
        original.copy_((new.t() if layer.fan_in_fan_out else new).to(original.dtype))
    initial = layer.__dict__.setdefault("initial_factors", {})
    initial[name] = (lora_a.detach().clone(), lora_b.detach().clone())


def refuse(model: nn.Module, config, targets: list[str], linear_types: tuple[type, ...], who: str) -> None:
    """Raise, before anything changes, if ``config.init`` cannot start every layer of ``targets``."""
    init = config.init
    if not rewrites_base(init):
        return
    lead = f"{who}(init={init!r})"
    if init.startswith("loftq") and config.quantize is None:
        raise ValueError(f"{lead}: LoftQ starts the adapter from the quantization error of the base, so it needs a "
                         "quantized base; pass quantize='nf4' (or 'int8'), or another init.")
    if init.startswith("loftq") and config.use_dora:
        raise ValueError(f"{lead}: LoftQ with use_dora=True is not implemented; use one of them.")
    for target in targets:
        module = model.get_submodule(target)
        if hasattr(module, "specs"):
            raise ValueError(f"{lead}: {target!r} already has LoRA adapter(s) {list(module.specs)}; this start "
                             "rewrites the base weight they were trained on. Adapt other modules, or use init="
                             "'kaiming' for a second adapter.")
        if not isinstance(module, linear_types):
            raise TypeError(f"{lead}: {target!r} is a {type(module).__name__}; this start is implemented for "
                            "nn.Linear and Conv1D layers (as in PEFT). Leave it out of target_modules.")
        weight = module.weight
        if is_quantized(weight) or not weight.dtype.is_floating_point:
            raise ValueError(f"{lead}: the base weight of {target!r} is {type(weight).__name__} {weight.dtype}; this "
                             "start needs the full-precision weight. Load the base unquantized and pass quantize=... "
                             "to LoRA, which quantizes after the start (the residual, as PiSSA's authors do).")
        reason = None if config.quantize is None else why_not(module, config.quantize)
        if reason:
            raise ValueError(f"{lead}: layer {target!r} cannot be quantized with {config.quantize!r}: {reason}; this "
                             "start quantizes the weight it rewrites, so every target must take it. Leave it out.")
        rank = config.rank_for(target)
        if rank > min(weight.shape):
            raise ValueError(f"{lead}: rank {rank} at {target!r} exceeds min{tuple(weight.shape)} of its weight, the "
                             "most singular directions it has; lower the rank (rank_pattern) or leave it out.")


def round_trip_for(method: str) -> Callable[[Tensor], Tensor]:
    """Quantize and dequantize with ``method`` (`lightning_peft.peft.quantize`)."""
    return lambda weight: dense_weight(quantized(weight, method))


def converted(state: dict[str, Tensor], keys: tuple[str, str], initial: tuple[Tensor, Tensor]) -> None:
    """In place: the trained factors under ``keys`` (A, B) become PEFT's rank-2r conversion with ``initial``."""
    key_a, key_b = keys
    a0, b0 = (t.to(state[k]) for t, k in zip(initial, keys))
    state[key_a] = torch.cat([state[key_a].detach(), a0], dim=0)  # (2r, in)
    state[key_b] = torch.cat([state[key_b].detach(), -b0], dim=1)  # (out, 2r)
