"""What prompt tuning and prefix tuning share on the adapter protocol (Hugging Face PEFT's "prompt learning").

Both keep their trained tensors in one small module attached to the Hugging Face model (``module_name``), change
each call with a forward pre-hook, and may train ``modules_to_save`` (a task head) in full. Both save in PEFT's
prompt-learning layout: ``adapter_model.safetensors`` holds ``prompt_embeddings`` (the prompt, or the prefix table)
and ``base_model.<module path>.<param>`` for saved modules (PEFT keeps a prompt-learning model at ``base_model``,
one level higher than for LoRA); these are full file keys, so ``peft_key_prefix`` is empty. Neither merges.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

from torch import Tensor, nn

from .._base_identity import base_model_name, task_type
from ..adapter import Adapter, clean_key, detach, unwrap
from ..modules_to_save import peft_saved_state, restore_modules, saved_state
from .embedding import input_embeddings, token_dim

#: The key of the prompt (prompt tuning) or prefix table (prefix tuning) in PEFT's ``adapter_model.safetensors``.
PEFT_PROMPT_KEY = "prompt_embeddings"
#: Prefix of ``modules_to_save`` keys in PEFT's file for prompt-learning methods.
PEFT_MODULE_PREFIX = "base_model."

#: The ``adapter_config.json`` fields of peft 0.21.2's ``PromptLearningConfig``, which both techniques' configs extend.
PROMPT_LEARNING_FIELDS = frozenset((
    "auto_mapping", "base_model_name_or_path", "inference_mode", "modules_to_save", "num_attention_heads",
    "num_layers", "num_transformer_submodules", "num_virtual_tokens", "peft_type", "peft_version", "revision",
    "task_type", "token_dim",
))

class PromptLearningAdapter(Adapter):
    """The shared half of [`PromptTuningAdapter`][lightning_peft.peft.PromptTuningAdapter] and
    [`PrefixTuningAdapter`][lightning_peft.peft.PrefixTuningAdapter].

    A subclass sets ``module_name`` (where its module sits on the model), ``technique`` (``"prompt tuning"``),
    ``thing`` (``"prompt"``) and ``not_a_weight`` (what it is instead of a weight update: why it cannot merge),
    and implements `table` and
    `remove_hook`.

    Args:
        modules_to_save: Full names of the modules trained and saved in full.
    """

    mergeable: ClassVar[bool] = False
    peft_key_prefix: ClassVar[str] = ""
    module_name: ClassVar[str]
    technique: ClassVar[str]
    thing: ClassVar[str]
    not_a_weight: ClassVar[str]

    def __init__(self, modules_to_save: Iterable[str]) -> None:
        self.modules_to_save = tuple(modules_to_save)

    @abstractmethod
    def table(self, model: nn.Module) -> Tensor:
        """What PEFT saves as ``prompt_embeddings``: ``(n, width)``."""

    @abstractmethod
    def remove_hook(self, model: nn.Module) -> None:
        """Remove the forward pre-hook the inject function registered."""

    def state(self, model: nn.Module) -> dict[str, Tensor]:
        model = unwrap(model)
        own = model.get_submodule(self.module_name).state_dict(prefix=f"{self.module_name}.", keep_vars=True)
        return {**own, **saved_state(model, self.modules_to_save)}

    def unload(self, model: nn.Module, merge: bool) -> None:
        if merge:
            raise RuntimeError(
                f"{type(self).__name__}: a {self.thing} cannot be merged into the base weights (it is "
                f"{self.not_a_weight}, not a weight update). Unload with merge=False, or keep the model adapted and "
                "save the adapter with save_adapter."
            )
        model = unwrap(model)
        self.remove_hook(model)
        delattr(model, self.module_name)
        restore_modules(model, self.modules_to_save)
        detach(model, self.kind)

    def peft_state(self, model: nn.Module) -> dict[str, Tensor]:
        """PEFT's full file keys: ``prompt_embeddings`` and ``base_model.<module>.<param>`` for saved modules."""
        saved = peft_saved_state(unwrap(model), self.modules_to_save, PEFT_MODULE_PREFIX)
        return {PEFT_PROMPT_KEY: self.table(model), **saved}

    def peft_common(self, model: nn.Module, task: str | None, num_virtual_tokens: int, token_dim: int,
                    num_attention_heads: int | None, num_layers: int | None) -> dict[str, Any]:
        """The ``adapter_config.json`` fields every PEFT prompt-learning config has."""
        return {
            "peft_type": self.peft_type,
            "task_type": task,
            "base_model_name_or_path": base_model_name(model),
            "revision": None,
            "inference_mode": True,
            "num_virtual_tokens": num_virtual_tokens,
            "token_dim": token_dim,
            "num_transformer_submodules": 1,
            "num_attention_heads": num_attention_heads,
            "num_layers": num_layers,
            "modules_to_save": [clean_key(n) for n in self.modules_to_save] or None,
        }

    def soft_prompt_common(self, model: nn.Module, num_virtual_tokens: int) -> dict[str, Any]:
        """`peft_common` for a prompt prepended to the input embeddings (prompt tuning, P-tuning)."""
        config = getattr(model, "config", None)
        return self.peft_common(model, task_type(model) or "FEATURE_EXTRACTION", num_virtual_tokens,
                                token_dim(input_embeddings(model, "save_adapter")),
                                _config_value(config, "num_attention_heads", "n_head", "num_heads"),
                                _config_value(config, "num_hidden_layers", "num_layers", "n_layer"))

    def check_prompt_length(self, config: Any, source: str, have: int) -> None:
        """Raise if a PEFT config's ``num_virtual_tokens`` is not ``have``, the model's prompt's."""
        n = self.peft_num_virtual_tokens(config, source)
        if n != have:
            raise ValueError(
                f"load_adapter: {source} has num_virtual_tokens={n}, but the model's {self.thing} has {have}. Load it "
                f"into a model without {self.technique}."
            )

    @classmethod
    def check_peft_shapes(cls, model: nn.Module, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], files,
                          inject: bool) -> None:
        """The table's rows are the file's own ``num_virtual_tokens``, and (``inject``) the file has the table:
        checked before a table of ``num_virtual_tokens`` rows is allocated."""
        n = cls.peft_num_virtual_tokens(config, str(files.config))
        shape = shapes.get(PEFT_PROMPT_KEY)
        if shape is None and inject:
            raise files.lacking([PEFT_PROMPT_KEY], "its adapter config asks for", type(unwrap(model)).__name__)
        if shape is not None and (len(shape) < 1 or shape[0] != n):
            raise files.torn(PEFT_PROMPT_KEY, shape, 0, "num_virtual_tokens", n)

    @classmethod
    def peft_num_virtual_tokens(cls, config: Any, source: str) -> int:
        """``num_virtual_tokens`` of a PEFT config of this technique; raises for another type or an
        encoder-decoder config (two stacks)."""
        if not isinstance(config, dict) or config.get("peft_type") != cls.peft_type:
            peft_type = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
            raise ValueError(f"load_adapter: {source} has peft_type={peft_type!r}, not {cls.peft_type!r}.")
        submodules = config.get("num_transformer_submodules")
        if submodules not in (None, 1):
            raise ValueError(
                f"load_adapter: {source} has num_transformer_submodules={submodules!r} (an encoder-decoder "
                f"{cls.thing}); lightning-peft's {cls.technique} covers one stack, of decoder and encoder models only. "
                "Load it with Hugging Face PEFT instead."
            )
        n = config.get("num_virtual_tokens")
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"load_adapter: {source} has num_virtual_tokens={n!r}; it is not a complete "
                             f"{cls.technique} config (a positive integer is needed).")
        return n


def check_token_dim(model: nn.Module, config: dict[str, Any], source: str) -> int:
    """The width ``d`` of ``model``'s input embeddings; raises if a PEFT config's ``token_dim`` is another."""
    width = token_dim(input_embeddings(model, "load_adapter"))
    if config.get("token_dim") not in (None, width):
        raise ValueError(
            f"load_adapter: {source} has token_dim={config['token_dim']}, but {type(model).__name__}'s input "
            f"embeddings are {width} wide. The adapter was trained on another model."
        )
    return width


def _config_value(config: Any, *keys: str) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None
