"""The documentation site builds strictly (as ``make docs`` does) and reads right once built.

One strict build per session, into a temporary folder; every check then reads the built HTML: nothing of the
docstrings' reST left on an API page, no raw Markdown on any page, every page in the navigation, every image and
every relative link present in the site, an anchor for every public name of every public import path. A strict
build that fails still writes the site, so the other checks run and say what else is wrong.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGES = ("callbacks", "strategies", "peft", "training", "nn", "modules", "data")


class _Reader(HTMLParser):
    """The text a reader sees (code apart), and the ids, image sources and link targets of one page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.prose: list[str] = []  # text outside <pre> and <code>, one entry per text node
        self.code: list[str] = []
        self.ids: set[str] = set()
        self.images: list[str] = []
        self.links: list[str] = []
        self.quoted: list[str] = []  # text three <blockquote> deep: a doctest's '>>>' read as Markdown quotes
        self._skip = 0  # inside <script> / <style>
        self._code = 0  # inside <pre> / <code>
        self._quote = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"])
        if tag == "img" and values.get("src"):
            self.images.append(values["src"])
        if tag == "a" and values.get("href"):
            self.links.append(values["href"])
        if tag in ("script", "style"):
            self._skip += 1
        if tag in ("pre", "code"):
            self._code += 1
        if tag == "blockquote":
            self._quote += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip -= 1
        if tag in ("pre", "code"):
            self._code -= 1
        if tag == "blockquote":
            self._quote -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            (self.code if self._code else self.prose).append(data)
            if self._quote >= 3 and data.strip():
                self.quoted.append(data.strip())


@dataclass
class Site:
    root: Path
    returncode: int
    log: str
    pages: dict[str, _Reader] = field(default_factory=dict)  # "reference/callbacks.html" -> what it holds


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    built = Site(out, done.returncode, done.stdout + done.stderr)
    for page in sorted(out.rglob("*.html")):
        reader = _Reader()
        reader.feed(page.read_text(encoding="utf-8"))
        built.pages[page.relative_to(out).as_posix()] = reader
    return built


def test_the_site_builds_strictly(site: Site) -> None:
    warnings = [line for line in site.log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert site.returncode == 0 and not warnings, "`make docs` fails:\n" + "\n".join(warnings or [site.log[-3000:]])


def _nav_pages(nav: list) -> list[str]:
    found = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        found += _nav_pages(value) if isinstance(value, list) else [value]
    return found


def test_every_page_is_in_the_navigation_and_built(site: Site) -> None:
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    assert sorted(nav) == pages, f"not in mkdocs.yml's nav: {sorted(set(pages) - set(nav))}; " \
                                 f"in the nav but not in docs/: {sorted(set(nav) - set(pages))}"
    assert len(nav) == len(set(nav)), "a page is twice in the nav"
    for page in pages:
        assert page.removesuffix(".md") + ".html" in site.pages, f"{page} was not built"
    # The navigation follows the layers: callbacks and strategies come before the blocks beneath them.
    order = [page for page in nav if page.startswith("reference/")]
    assert order == [f"reference/{name}.md" for name in PACKAGES]
    assert nav.index("lora.md") < nav.index("zero.md") < nav.index("attention.md")


def test_every_image_and_every_relative_link_is_in_the_site(site: Site) -> None:
    shown = set()
    for name, page in site.pages.items():
        if name == "404.html":  # served at any missing address, so its links are absolute by design
            continue
        for kind, targets in (("image", page.images), ("link", page.links)):
            for target in targets:
                parts = urlsplit(target)
                if parts.scheme or parts.netloc or not parts.path:  # another site, or an anchor of this page
                    continue
                path = (site.root / name).parent / unquote(parts.path)
                assert path.exists(), f"{name}: the {kind} {target} is not in the site"
                if kind == "image":
                    shown.add(path.resolve())
    for image in (DOCS / "img").glob("*.png"):
        assert (site.root / "img" / image.name).resolve() in shown, f"docs/img/{image.name} is shown on no page"


def test_links_to_repository_files_outside_docs_reach_a_copy(site: Site) -> None:
    # docs/zero.md links ../benchmarks/bench_zero.py, as GitHub shows it; on the site that is a copy under src/.
    assert "src/benchmarks/bench_zero.py" in site.pages["zero.html"].links
    copy = site.root / "src" / "benchmarks" / "bench_zero.py"
    assert copy.read_bytes() == (ROOT / "benchmarks" / "bench_zero.py").read_bytes()


# reST that a Markdown renderer shows as it is: roles, directives, literal-block markers, grid tables.
REST_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|exc|data|obj|const|ref|doc)(?::|`)")
REST_DIRECTIVE = re.compile(r"\.\. (?:code-block|code|note|warning|math|versionadded|seealso)\b")
REST_LITERAL = re.compile(r"::\s*$", re.M)
REST_GRID = re.compile(r"^\s*\+[-=]{3,}[-=+]*\+\s*$", re.M)


def _prose(page: _Reader) -> str:
    return "".join(page.prose)


def test_no_raw_rest_on_the_api_pages(site: Site) -> None:
    problems = []
    for name in PACKAGES:
        page = site.pages[f"reference/{name}.html"]
        prose, everything = _prose(page), _prose(page) + "".join(page.code)
        for what, pattern, text in (("a role", REST_ROLE, prose), ("a directive", REST_DIRECTIVE, everything),
                                    ("a line ending in '::'", REST_LITERAL, prose),
                                    ("a grid table", REST_GRID, everything)):
            found = sorted({m.group(0).strip() or "::" for m in pattern.finditer(text)})
            count = len(pattern.findall(text))
            if count:
                line = next(line for line in text.splitlines() if pattern.search(line))
                problems.append(f"reference/{name}.html: {count} x {what} ({', '.join(found)}), e.g. {line.strip()!r}")
        if page.quoted:  # an example outside an ``Examples:`` section is Markdown, where '>>>' nests quotes
            problems.append(f"reference/{name}.html: {len(page.quoted)} x a doctest shown as nested quotes, "
                            f"e.g. {page.quoted[0]!r}")
    assert not problems, "raw reST shown on the API pages:\n" + "\n".join(problems)


# Markdown that did not render: a fence, a table row, a link or an emphasis left as text.
RAW_MARKDOWN = {
    "a code fence": re.compile(r"^\s*(?:```|~~~)", re.M),
    "a table row": re.compile(r"^\s*\|(?:\s*:?-{3,}:?\s*\|)+\s*$", re.M),
    "a link": re.compile(r"\]\((?:[\w./#-]+)\)"),
}


def test_no_raw_markdown_on_any_page(site: Site) -> None:
    problems = []
    for name, page in site.pages.items():
        prose = _prose(page)
        for what, pattern in RAW_MARKDOWN.items():
            match = pattern.search(prose)
            if match:
                problems.append(f"{name}: {what} shown as text: {match.group(0).strip()!r}")
    assert not problems, "\n".join(problems)


def _exports(package: str) -> list[str]:
    """``__all__`` of ``lightning_peft.<package>``, read from its source (importing it would import Lightning)."""
    tree = ast.parse((ROOT / "lightning_peft" / package / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"lightning_peft.{package} has no __all__")


def test_every_public_name_has_an_anchor_on_its_api_page(site: Site) -> None:
    missing = {}
    for package in PACKAGES:
        ids = site.pages[f"reference/{package}.html"].ids
        names = _exports(package)
        assert names, package
        absent = [name for name in names if f"lightning_peft.{package}.{name}" not in ids]
        absent += [] if f"lightning_peft.{package}" in ids else ["(the package itself)"]
        if absent:
            missing[package] = absent
    assert not missing, f"public names without an anchor on their API page: {missing}"
