"""The ``lightning-peft`` command: ``lightning-peft fit|validate|test|predict --config x.yaml``.

A `LightningCLI` in subclass mode: the YAML names any LightningModule and LightningDataModule with
``class_path``/``init_args``, and any callback or strategy of this package (or another) under ``trainer``.
Classes of this package may also be named without their module, as Lightning's own are:
``--trainer.callbacks+=GradientNoise --trainer.callbacks.eta=0.01``, ``--model HFSequenceClassifier``, and the strategies
by their registered names: ``--trainer.strategy zero3``.
One extra top-level option, ``test_after_fit`` (``--test_after_fit true``), makes ``fit`` finish with
``trainer.test`` on the final weights (the ones ``MergeOnSave`` exports, so the printed metrics describe the
model on disk) and print the test metrics. Other subcommands accept and ignore it, so one YAML serves them all.

Example:
    ``lightning-peft fit --config examples/configs/lora_minilm_bbc_news.yaml``
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

# Imported for their classes: jsonargparse resolves a bare class name (``--trainer.callbacks+=LoRA``,
# ``--model HFSequenceClassifier``) only among the subclasses already imported.
import lightning_peft.callbacks  # noqa: F401
import lightning_peft.data  # noqa: F401
import lightning_peft.modules  # noqa: F401
import lightning_peft.strategies  # noqa: F401  (also registers zero1, zero3_native, ... by name)
from lightning_peft.peft.lora.config import PEFT_NAMES

__all__ = ["PeftCLI", "main"]


class PeftCLI(LightningCLI):
    """`LightningCLI` with ``--test_after_fit``: run the test loop at the end of ``fit``."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Adds ``--test_after_fit`` (used by ``fit`` only)."""
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=False,
            help="fit only: after training, run the test loop on the final weights and print the metrics.",
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Checks the callbacks of the YAML files (and of ``args`` given as a dict) first: jsonargparse's own message
        for a key at the wrong place or under PEFT's name lists the union of types it tried, not the key's fix."""
        for source, config in _configs(args):
            for subcommand in (None, "fit", "validate", "test", "predict"):
                section = config.get(subcommand, {}) if subcommand else config
                trainer = section.get("trainer") if isinstance(section, dict) else None
                if isinstance(trainer, dict):
                    check_callback_entries(trainer.get("callbacks"), source)
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        """Refuses an unknown ``--trainer.strategy`` name, listing this package's names (Lightning's list has none), and
        a second entry of one of this package's callbacks."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.get("trainer") or {}
        check_strategy_name(trainer.get("strategy"))
        check_unique_callbacks(trainer.get("callbacks"))

    def after_fit(self) -> None:
        """Runs ``trainer.test`` when ``test_after_fit`` is set and prints the resulting metrics."""
        if not self.config[self.subcommand].get("test_after_fit", False):
            return
        # The final weights, not "best": MergeOnSave exported these, and the metrics should describe them.
        results = self.trainer.test(self.model, datamodule=self.datamodule)
        if self.trainer.is_global_zero:
            print(_format_test_results(results))


def check_strategy_name(strategy: Any) -> None:
    """Raise for a strategy name that neither Lightning nor this package registered (other values pass).

    Raises:
        ValueError: Naming the closest registered names, lightning-peft's and Lightning's.
    """
    if not isinstance(strategy, str):
        return
    names = StrategyRegistry.available_strategies()
    if strategy.lower() == "auto" or strategy.lower() in names:
        return
    ours = [n for n in names if StrategyRegistry[n]["strategy"].__module__.startswith("lightning_peft.")]
    theirs = ["auto", *(n for n in names if n not in ours)]
    close = difflib.get_close_matches(strategy.lower(), ours + theirs, n=3)
    hint = f" Did you mean {' or '.join(repr(n) for n in close)}?" if close else ""
    raise ValueError(
        f"lightning-peft: --trainer.strategy {strategy!r} is not a registered strategy name.{hint} "
        f"lightning-peft's: {', '.join(ours)}. Lightning's: {', '.join(theirs)}. Or give a class: "
        "--trainer.strategy lightning_peft.strategies.ZeROStrategy --trainer.strategy.stage 3."
    )


def check_unique_callbacks(callbacks: Any) -> None:
    """Raise for two entries of one lightning-peft callback class under ``trainer.callbacks``.

    Lightning refuses them too, but from inside ``Trainer(...)`` with a message about ``state_key``; the usual cause is
    ``--trainer.callbacks+=LoRA ...`` on a config that already lists ``LoRA``.

    Raises:
        ValueError: Naming the class, the entries and what to do instead.
    """
    seen: dict[str, list[int]] = {}
    for index, entry in enumerate(callbacks if isinstance(callbacks, list) else []):
        class_path = entry.get("class_path") if hasattr(entry, "get") else None
        if isinstance(class_path, str) and class_path.startswith("lightning_peft."):
            seen.setdefault(class_path, []).append(index)
    for class_path, indices in seen.items():
        if len(indices) > 1:
            name = class_path.rsplit(".", 1)[-1]
            raise ValueError(
                f"lightning-peft: trainer.callbacks lists {name} {len(indices)} times (entries {indices}); a Trainer "
                f"takes one {name}. The config probably has one already: change its init_args in the YAML (or give "
                f"a config without {name}) instead of adding another with --trainer.callbacks+={name}."
            )


def _configs(args: ArgsType) -> list[tuple[str, dict]]:
    """``(source, content)`` of the configs that ``args`` (``None``: ``sys.argv``) gives: a dict itself, the YAML files
    of ``--config`` / ``-c`` (files that cannot be read are left to the parser)."""
    if isinstance(args, dict):
        return [("the config", args)]
    argv = [str(a) for a in (sys.argv[1:] if args is None else args if isinstance(args, list) else [])]
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    found = []
    for path in paths:
        try:
            content = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(content, dict):
            found.append((path, content))
    return found


def check_callback_entries(callbacks: Any, source: str) -> None:
    """Raise for a ``trainer.callbacks`` entry whose arguments sit beside ``class_path`` instead of under
    ``init_args``, and for a lightning-peft callback given Hugging Face PEFT's name of an argument (``r``) or a
    misspelt one close to an argument it has (``rnak``: did you mean ``rank``?). A key close to none is left to
    jsonargparse, whose message names it.

    Raises:
        ValueError: Naming the file, the entry, the key and the fix.
    """
    for index, entry in enumerate(callbacks if isinstance(callbacks, list) else [callbacks]):
        if not isinstance(entry, dict) or not isinstance(entry.get("class_path"), str):
            continue
        class_path = entry["class_path"]
        name = class_path.rsplit(".", 1)[-1]
        beside = [k for k in entry if k not in ("class_path", "init_args", "dict_kwargs", "__path__")]
        if beside:
            lines = "".join(f"\n      {k}: {entry[k]!r}" for k in beside)
            raise ValueError(
                f"lightning-peft: {source}: trainer.callbacks[{index}] ({name}) gives {', '.join(map(repr, beside))} "
                f"beside class_path; a callback's arguments go under init_args:\n  - class_path: {class_path}\n"
                f"    init_args:{lines}"
            )
        init_args = entry.get("init_args")
        taken = _parameters(class_path)
        for key in init_args if isinstance(init_args, dict) and taken else []:
            ours = PEFT_NAMES.get(key)
            if key not in taken and ours in taken:
                raise ValueError(
                    f"lightning-peft: {source}: trainer.callbacks[{index}]: {name} has no argument {key!r}; Hugging "
                    f"Face PEFT's {key} is {ours!r} here. Write {ours}: {init_args[key]!r} under init_args."
                )
            close = difflib.get_close_matches(key, taken, n=1) if key not in taken else []
            if close:
                raise ValueError(
                    f"lightning-peft: {source}: trainer.callbacks[{index}]: {name} has no argument {key!r}; did you "
                    f"mean {close[0]!r}? Write {close[0]}: {init_args[key]!r} under init_args ({name} takes "
                    f"{', '.join(taken)})."
                )


def _parameters(class_path: str) -> list[str]:
    """The named constructor arguments of a lightning-peft callback named by ``class_path``, in order (bare names
    resolve as the parser resolves them); empty for another class, one that cannot be imported, or one whose
    ``**kwargs`` may take more (LoRA's ``**peft_names`` only catches PEFT's names, to refuse them)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module or "lightning_peft.callbacks"), name)
    except (ImportError, AttributeError, ValueError):
        return []
    if not inspect.isclass(cls) or not cls.__module__.startswith("lightning_peft."):
        return []
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD and n != "peft_names" for n, p in parameters.items()):
        return []
    return [n for n, p in parameters.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _format_test_results(results: list[dict[str, float]]) -> str:
    """One line per test dataloader: ``name=value`` for each metric."""
    lines = ["Test metrics (final weights):"]
    if not any(results):  # e.g. a datamodule with test_fraction=0: the loop ran no batch
        return lines[0] + " none: the test loop logged no metric (an empty test split?)."
    for metrics in results:
        lines.append("  " + "  ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items())))
    return "\n".join(lines)


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-peft`` console script.

    Args:
        args: Command-line arguments (a list, as ``sys.argv[1:]``); ``None`` reads ``sys.argv``.
    """
    PeftCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
