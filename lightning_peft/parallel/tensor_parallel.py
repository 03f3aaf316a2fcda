"""Tensor parallelism (Megatron-style) on DTensor ``parallelize_module``, with an automatic, LoRA-aware plan, without
Lightning ([`TensorParallelStrategy`][lightning_peft.strategies.TensorParallelStrategy] is the glue).

Paper: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism",
arXiv:1909.08053. Engine: ``torch.distributed.tensor.parallel`` (DTensor); no new engine is written here.

The rule. A block's first projections are split column-wise and its last ones row-wise, so one all-reduce per
sublayer (in forward, and one in backward) is all the communication:

```text
colwise  Y_i = X W_i^T           W_i = rows i*out/t .. (i+1)*out/t of W (out, in);  Y sharded on its last dim
rowwise  Y   = sum_i X_i W_i^T   W_i = columns i*in/t .. of W; X_i the matching slice of the sharded input
```

With LoRA (``y = W x + s B (A x)``, A (r, in), B (out, r)) the adapter follows its base:

    colwise base:  A replicated, B column-wise  -> hidden A x (r,) is full on every rank, s B_i (A x) is the
                   rank's output slice. Backward: d(hidden) = sum_i B_i^T dy_i is a sum over ranks (an all-reduce
                   of an r-wide tensor) before it reaches A's gradient and the input's.
    rowwise base:  A row-wise (its input dim sharded), B replicated -> hidden = sum_i A_i x_i is partial on each
                   rank and joins the base output's partial sum, so one all-reduce covers both.

LoRA's linear layer reads ``lora_A[n].weight`` with ``F.linear`` directly, so per-module hooks on ``lora_A`` /
``lora_B`` never fire. The parallel style is therefore put on the whole wrapper: its input becomes a DTensor
(replicated for column-wise, sharded on the last dim for row-wise), every parameter inside (base, A, B) is a DTensor
with the placement above, and the adapter arithmetic runs on DTensors, whose autograd inserts the all-reduce of the
hidden gradient (a ``Partial`` placement reduced where it meets a replicated tensor). Gradients of replicated
parameters are therefore full and equal on every rank. A wrapper whose class declares ``tensor_parallel_split``
(``{style: the factor that splits with its base}``, as LoRA's layers do) is planned as one unit; other wrappers
(bottleneck adapters) are transparent: a plan sees the layers inside them.

Attention: each rank keeps whole heads. The plan divides the local head-count attributes the modules use to
reshape (``num_heads``/``num_kv_heads`` of `lightning_peft.nn.FlashAttention`, ``num_attention_heads`` /
``all_head_size`` of BERT's self-attention; Llama reshapes with ``-1``), and refuses a size that does not
divide the heads, the key/value heads, or a split dimension.

Shapes (t = tensor-parallel size):

| module | local parameters | local input -> local output |
| --- | --- | --- |
| colwise Linear | W (out/t, in), b out/t | (..., in) full -> (..., out/t) (or gathered: a head) |
| rowwise Linear | W (out, in/t), b full | (..., in/t) -> (..., out) full (all-reduced) |
| rowwise Embedding | W (V/t, H) | (B, L) ids -> (B, L, H) full (all-reduced) |
| LoRA on colwise | A (r, in), B (out/t, r) | |
| LoRA on rowwise | A (r, in/t), B (out, r) | |

Data parallelism (a 2-D mesh ``(data_parallel, tensor_parallel)``): the ranks of one tensor-parallel group see the
same batch; the model is broadcast from the first data-parallel replica at setup, and the trainable parameters'
gradients are averaged over the data-parallel group after each backward, as DDP does (see ``parallel/dtensor.py``).
"""

from __future__ import annotations

import fnmatch
import re
from functools import partial
from typing import Any

from torch import nn

__all__ = ["STYLES", "auto_plan", "check_plan_styles", "parallelize", "resolve_plan"]

STYLES = ("colwise", "rowwise")
WHO = "TensorParallelStrategy"
_AUTO_RULES: list[tuple[str, str]] = [
    (r"(?:^|\.)(?:attn|self_attn)\.(?:q_proj|k_proj|v_proj)$", "colwise"),
    (r"(?:^|\.)(?:attn|self_attn)\.o_proj$", "rowwise"),
    (r"(?:^|\.)mlp\.(?:up_proj|gate_proj)$", "colwise"),
    (r"(?:^|\.)mlp\.down_proj$", "rowwise"),
    (r"(?:^|\.)attention\.self\.(?:query|key|value)$", "colwise"),
    (r"(?:^|\.)attention\.output\.dense$", "rowwise"),
    (r"(?:^|\.)intermediate\.dense$", "colwise"),
    (r"(?:^|\.)layer\.\d+\.output\.dense$", "rowwise"),
]
_AUTO_EMBEDDINGS = r"(?:^|\.)(?:embed_tokens|word_embeddings)$"  # row-wise: vocabulary split
_AUTO_HEADS = r"(?:^|\.)lm_head$"  # column-wise, output gathered
_HEAD_ATTRIBUTES = ("num_heads", "num_kv_heads", "num_attention_heads", "num_key_value_heads")
_WIDTH_ATTRIBUTES = ("all_head_size",)


# ------------------------------------------------------------------------------------------------ the plan


def _split(module: nn.Module) -> dict[str, str] | None:
    """A plan unit's ``tensor_parallel_split``, read from its class (a wrapper may forward attributes to its base);
    ``{}``: it cannot be split (refused if planned; e.g. its base is no ``nn.Linear``); None: not a unit."""
    split = getattr(type(module), "tensor_parallel_split", None)
    if not isinstance(split, dict):
        return None
    return split if isinstance(module.base_layer, nn.Linear) else {}


def _targets(model: nn.Module) -> dict[str, nn.Module]:
    """Modules a plan can name: Linear and Embedding leaves and wrappers planned as a unit (not what is inside)."""
    found: dict[str, nn.Module] = {}
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if _split(module) is not None:
            inside.append(f"{name}." if name else "")
            found[name] = module
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            found[name] = module
    return found


def _base(module: nn.Module) -> nn.Module:
    return module.base_layer if _split(module) is not None else module


def _is_tied(model: nn.Module, module: nn.Module) -> bool:
    """Whether the module's weight is also another module's parameter (tied embeddings and head)."""
    weight = _base(module).weight
    return sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p is weight) > 1


def auto_plan(model: nn.Module, tensor_parallel_size: int = 2) -> dict[str, str]:
    """The plan ``plan="auto"`` applies to ``model``: ``{module name: "colwise" | "rowwise"}``.

    Projections of the project's blocks, Llama-style and BERT-style models are always planned (a size that does
    not divide them is refused later); the token embedding (row-wise) and the ``lm_head`` (column-wise, output
    gathered) only when ``tensor_parallel_size`` divides the vocabulary and their weight is not tied.

    Examples:
        >>> from lightning_peft.nn import TransformerDecoder
        >>> decoder = TransformerDecoder(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, ffn_size=32)
        >>> sorted(auto_plan(decoder).items())[:3]
        [('embed_tokens', 'rowwise'), ('layers.0.attn.k_proj', 'colwise'), ('layers.0.attn.o_proj', 'rowwise')]
    """
    plan: dict[str, str] = {}
    for name, module in _targets(model).items():
        base = _base(module)
        if isinstance(base, nn.Linear):
            style = next((s for pattern, s in _AUTO_RULES if re.search(pattern, name)), None)
            if style is None and re.search(_AUTO_HEADS, name) and not _is_tied(model, module):
                style = "colwise" if base.out_features % tensor_parallel_size == 0 else None
            if style is not None:
                plan[name] = style
        elif isinstance(base, nn.Embedding) and _split(module) is None:
            if re.search(_AUTO_EMBEDDINGS, name) and not _is_tied(model, module):
                if base.num_embeddings % tensor_parallel_size == 0:
                    plan[name] = "rowwise"
    return plan


def _matches(name: str, pattern: str) -> bool:
    """A plan pattern names a module by its full dotted name or a dotted suffix, with ``*`` wildcards."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")


def _linear_names(model: nn.Module) -> str:
    """A short summary of the Linear modules' last names, for error messages."""
    counts: dict[str, int] = {}
    for name, module in _targets(model).items():
        if isinstance(_base(module), nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            counts[leaf] = counts.get(leaf, 0) + 1
    return ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in counts.items()) or "none"


def check_plan_styles(plan: object, who: str = WHO) -> None:
    """Static checks of a plan argument (no model needed): ``"auto"`` or ``{pattern: "colwise" | "rowwise"}``."""
    if plan == "auto":
        return
    if not isinstance(plan, dict) or not plan:
        raise ValueError(
            f"{who}(plan={plan!r}): give 'auto' or a non-empty dict {{module name pattern: 'colwise' | 'rowwise'}}, "
            "e.g. {'q_proj': 'colwise', 'o_proj': 'rowwise'}."
        )
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or style not in STYLES:
            raise ValueError(
                f"{who}(plan={{{pattern!r}: {style!r}}}): a plan maps module name patterns to 'colwise' or "
                "'rowwise'; column-wise splits the output features (q, k, v, up, gate), row-wise the input "
                "features (o, down), so that they pair up."
            )


def resolve_plan(model: nn.Module, plan: str | dict[str, str], tensor_parallel_size: int) -> dict[str, str]:
    """The exact plan ``{module name: style}`` for ``model``, checked against the tensor-parallel size.

    Args:
        model: The model (LoRA already injected, if any).
        plan: ``"auto"`` or ``{module name pattern: "colwise" | "rowwise"}``; a pattern is a full dotted name or
            a dotted suffix (``q_proj``, ``layers.*.mlp.up_proj``), ``*`` matching anything.
        tensor_parallel_size: The number of ranks a module is split over.

    Raises:
        ValueError: For an unknown style, a pattern matching no module, a pattern matching a module that is not a
            Linear or Embedding (or an adapter on a Linear), a model the automatic plan does not recognise, or a size
            that does not divide the heads, the key/value heads or a split dimension.
    """
    check_plan_styles(plan)
    who = f"{WHO}(tensor_parallel_size={tensor_parallel_size})"
    model_name = type(model).__name__
    if plan == "auto":
        resolved = auto_plan(model, tensor_parallel_size)
        if not any(isinstance(_base(m), nn.Linear) for n, m in _targets(model).items() if n in resolved):
            raise ValueError(
                f"{WHO}(plan='auto') recognises no module of {model_name}: it knows the projections of "
                "lightning_peft.nn blocks (attn.q_proj, mlp.up_proj, ...), Llama-style (self_attn.q_proj, ...) "
                "and BERT-style (attention.self.query, intermediate.dense, ...) models. Give a plan, e.g. "
                "TensorParallelStrategy(plan={'fc1': 'colwise', 'fc2': 'rowwise'}) (column-wise for the first "
                "projection of a block, row-wise for the last). Linear modules it has: "
                f"{_linear_names(model)}."
            )
    else:
        targets = _targets(model)
        resolved = {}
        for pattern, style in plan.items():
            matched = [n for n in targets if _matches(n, pattern)]
            if not matched:
                other = [n for n, _ in model.named_modules() if n and _matches(n, pattern)]
                if other:
                    kind = type(model.get_submodule(other[0])).__name__
                    raise ValueError(
                        f"{WHO}(plan={{{pattern!r}: {style!r}}}) matches {other[0]!r} ({kind}), which is not a "
                        "Linear or Embedding module; name the Linear projections inside it."
                    )
                raise ValueError(
                    f"{WHO}(plan={{{pattern!r}: {style!r}}}) matches no module of {model_name}. Linear modules "
                    f"it has: {_linear_names(model)}."
                )
            for name in matched:
                resolved[name] = style
    _check_plan(model, resolved, tensor_parallel_size, who)
    return resolved


def _check_plan(model: nn.Module, plan: dict[str, str], size: int, who: str) -> None:
    targets = _targets(model)
    for name, style in plan.items():
        module = targets[name]
        base = _base(module)
        if _split(module) == {}:
            raise ValueError(
                f"{WHO}: {name!r} is a {type(module).__name__} on a {type(base).__name__}; tensor parallelism "
                "supports LoRA on nn.Linear layers only. Leave this module out of the plan (it stays replicated)."
            )
        if isinstance(base, nn.Linear):
            dim, what = (base.out_features, "output") if style == "colwise" else (base.in_features, "input")
            shape = f"{base.in_features} -> {base.out_features}"
        else:
            dim, what = (base.embedding_dim, "embedding") if style == "colwise" else (base.num_embeddings, "vocabulary")
            shape = f"{base.num_embeddings} x {base.embedding_dim}"
        if dim % size:
            raise ValueError(
                f"{who}: {name!r} ({type(base).__name__} {shape}) is split {style} over its {dim} {what} "
                f"features, and {size} does not divide {dim}; choose a tensor_parallel_size that divides the "
                "hidden, head and feed-forward sizes."
            )
        if _is_tied(model, module):
            raise ValueError(
                f"{WHO}: {name!r} shares its weight with another module (tied embeddings); a tied weight cannot "
                "be split twice. Leave it out of the plan."
            )
    for parent_name, parent in _attention_parents(model, plan):
        heads = _head_counts(parent)
        bad = {k: v for k, v in heads.items() if v % size}
        if bad:
            listed = ", ".join(f"{k}={v}" for k, v in heads.items())
            raise ValueError(
                f"{who}: {parent_name or 'the model'!r} ({type(parent).__name__}) has {listed}; each rank must "
                f"hold whole attention heads, so tensor_parallel_size must divide every head count. Choose one of "
                f"{[d for d in range(1, min(heads.values()) + 1) if all(v % d == 0 for v in heads.values())]}."
            )
        children = [n for n, m in parent.named_children() if isinstance(_base(m), nn.Linear)]
        prefix = f"{parent_name}." if parent_name else ""
        planned = [c for c in children if prefix + c in plan]
        if planned and len(planned) != len(children):
            raise ValueError(
                f"{WHO}: the plan splits {', '.join(planned)} of {parent_name!r} but not "
                f"{', '.join(c for c in children if c not in planned)}; shard the query, key and value projections "
                "alike (column-wise) and the output projection row-wise, or none of them."
            )


def _head_counts(module: nn.Module) -> dict[str, int]:
    counts = {a: getattr(module, a) for a in _HEAD_ATTRIBUTES if isinstance(getattr(module, a, None), int)}
    config = getattr(module, "config", None)
    if not counts and "Attention" in type(module).__name__ and config is not None and not isinstance(config, dict):
        # Llama-style attention: the counts only in the (shared, unchanged) config; it reshapes with -1
        counts = {a: getattr(config, a) for a in _HEAD_ATTRIBUTES if isinstance(getattr(config, a, None), int)}
    return counts


def _attention_parents(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module]]:
    """The parents of planned modules that hold head counts (the attention modules)."""
    parents: dict[str, nn.Module] = {}
    for name in plan:
        parent_name = name.rsplit(".", 1)[0] if "." in name else ""
        parent = model.get_submodule(parent_name)
        if _head_counts(parent):
            parents[parent_name] = parent
    return list(parents.items())


# ------------------------------------------------------------------------------------------------ applying it


def _gathered_output(plan: dict[str, str], name: str, targets: dict[str, nn.Module]) -> bool:
    """A column-wise Linear feeds a row-wise Linear of its own block (same parent or grandparent: attention, MLP,
    BERT's intermediate -> output), which takes the sharded output; otherwise (a head) its output is gathered."""
    def ancestors(n: str) -> tuple[str | None, str | None]:
        parts = n.split(".")
        return (".".join(parts[:-1]), ".".join(parts[:-2]) if len(parts) > 1 else None)

    parent, grandparent = ancestors(name)
    for other, style in plan.items():
        if style != "rowwise" or not isinstance(_base(targets[other]), nn.Linear):
            continue
        p, g = ancestors(other)
        if p == parent or (grandparent is not None and g == grandparent):
            return False
    return True


def _styles():
    """The two adapter-aware parallel styles (built lazily: torch.distributed may be absent)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class Wrapped:
        """The style on a whole wrapper that declares ``tensor_parallel_split`` (other modules: the style itself).
        Column-wise: the base's and the split factor's parameters on their output dim; row-wise: their weights on
        the input dim (biases replicated); distribute_module replicates the rest. ``kind``: the subclass's style."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            split = _split(module)
            if not split:
                return super()._apply(module, device_mesh)
            factor, colwise = f"{split[self.kind]}.", self.kind == "colwise"
            if not colwise:
                self.desired_input_layouts = (Shard(-1),)  # RowwiseParallel sets it for a Linear or Embedding only

            def partition(name: str, sub: nn.Module, mesh) -> None:
                if name != "base_layer" and not (name.startswith(factor) and isinstance(sub, nn.Linear)):
                    return
                for key in [k for k, p in sub._parameters.items() if p is not None] if colwise else ["weight"]:
                    param = sub._parameters[key]
                    sub.register_parameter(key, nn.Parameter(distribute_tensor(
                        param.data, mesh, [Shard(0 if colwise else 1)], src_data_rank=self.src_data_rank,
                    ), requires_grad=param.requires_grad))

            return distribute_module(
                module, device_mesh, partition,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            )

    class AdapterColwise(Wrapped, ColwiseParallel):
        kind = "colwise"

    class AdapterRowwise(Wrapped, RowwiseParallel):
        kind = "rowwise"

    return AdapterColwise, AdapterRowwise, Replicate


def parallelize(model: nn.Module, mesh: Any, plan: str | dict[str, str] = "auto") -> dict[str, str]:
    """Split ``model`` over the 1-D ``mesh`` (its ranks: one tensor-parallel group) in place; adapter-aware.

    Every rank of the mesh must call this with the same model; the values are taken from the mesh's first rank.
    Head-count attributes of the attention modules become the local counts.

    Args:
        model: The model, with any LoRA adapters already injected.
        mesh: A 1-D ``DeviceMesh``.
        plan: ``"auto"`` or ``{module name pattern: "colwise" | "rowwise"}`` (see `resolve_plan`).

    Returns:
        The applied plan ``{module name: style}``.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    size = mesh.size()
    resolved = resolve_plan(model, plan, size)
    colwise, rowwise, replicate = _styles()
    targets = _targets(model)
    styles = {}
    for name, style in resolved.items():
        if style == "colwise":
            gather = _gathered_output(resolved, name, targets)
            styles[name] = colwise(output_layouts=replicate()) if gather else colwise()
        elif isinstance(_base(targets[name]), nn.Embedding):
            styles[name] = rowwise(input_layouts=replicate())  # token ids are whole on every rank
        else:
            styles[name] = rowwise()
    for _, parent in _attention_parents(model, resolved):
        for attribute in (*_HEAD_ATTRIBUTES, *_WIDTH_ATTRIBUTES):
            value = parent.__dict__.get(attribute)
            if isinstance(value, int):
                setattr(parent, attribute, value // size)
    parallelize_module(model, mesh, styles)
    return resolved


