"""Griffe extension for the API reference: leaves out the framework methods a reader never calls.

A callback's ``on_train_batch_start``, a strategy's ``setup_environment`` or a LightningModule's ``training_step``
are Lightning's hooks: Lightning calls them, the reader configures the class through its constructor. Listing them
beside the constructor's arguments buries what a reader needs, so members of the Lightning layers' classes named like
Lightning's hooks (the names below: those of ``Callback``, ``LightningModule``, ``LightningDataModule`` and the
strategies that ``lightning_peft`` overrides, not ``torch.nn.Module``'s) and Python's special methods (but
``__call__`` and ``__new__``, which are API here) are left out of the reference. A fixed list, not an import of Lightning:
the build stays static and fast. Undocumented attributes of any class (its state: ``self.config``, the
submodules of a block) and undocumented methods of the Lightning layers' classes (the adapter callbacks' plumbing)
are left out too; every name a package exports in ``__all__`` is shown, with a docstring or without.
"""

from __future__ import annotations

from typing import Any

from griffe import Class, Extension, GriffeLoader

LIGHTNING_LAYERS = ("lightning_peft.callbacks", "lightning_peft.strategies", "lightning_peft.modules",
                    "lightning_peft.data")
HOOKS = frozenset({
    "backward", "distributed_sampler_kwargs", "is_distributed", "lightning_module_state_dict", "load_checkpoint",
    "load_model_state_dict", "load_optimizer_state_dict", "model_to_device", "on_before_optimizer_step",
    "on_exception", "on_fit_end", "on_fit_start", "on_load_checkpoint", "on_save_checkpoint", "on_test_batch_end",
    "on_train_batch_end", "on_train_batch_start", "on_train_start", "on_validation_batch_end", "parallel_devices",
    "post_backward", "predict_dataloader", "predict_step", "remove_checkpoint", "restore_checkpoint_after_setup",
    "root_device", "save_checkpoint", "setup", "setup_environment", "teardown", "test_dataloader", "test_step",
    "train_dataloader", "training_step", "val_dataloader", "validation_step",
})
SPECIAL_KEPT = frozenset({"__init__", "__call__", "__new__"})


class HideFrameworkMembers(Extension):
    """Leaves Lightning hooks (in the Lightning layers) and special methods (everywhere) out of the reference."""

    def on_class(self, *, cls: Class, loader: GriffeLoader, **kwargs: Any) -> None:
        lightning = cls.path.startswith(LIGHTNING_LAYERS)
        for name, member in list(cls.members.items()):
            special = name.startswith("__") and name.endswith("__") and name not in SPECIAL_KEPT
            # An attribute without a docstring (``self.config = ...``, a submodule of a block) is the class's
            # state, described by the class docstring if at all; so is an undocumented method of the glue.
            undocumented = not member.is_alias and not member.has_docstring and (
                member.is_attribute or (lightning and member.is_function and name != "__init__"))
            if special or undocumented or (lightning and name in HOOKS):
                # Removed, not marked private: the re-exported classes (``lightning_peft.callbacks.LoRA`` is an
                # alias of ``lightning_peft.callbacks.lora.LoRA``) wrap their members in new aliases, which do not
                # carry the mark.
                cls.del_member(name)
