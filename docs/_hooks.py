"""MkDocs hook: links from ``docs/`` to repository files outside it resolve on the site.

A page may link a script or a config the way GitHub shows it, relative to the page (``../benchmarks/bench_zero.py``,
``../examples/configs/lora_minilm_bbc_news.yaml``). The site holds only ``docs/``, so such a link would be dead
there. This hook copies every repository file a page links to under ``src/`` in the site, as it is (a plain file
the browser shows), and rewrites the link to that copy. A link to a repository file that does not exist is left
alone, so the strict build reports it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

SOURCE = "src"  # where the copies live in the site
# A Markdown link or image target: ](target) or ](target#anchor), not an absolute URL.
LINK = re.compile(r"(\]\()(?P<target>[^)\s#]+)(?P<rest>(?:#[^)\s]*)?\))")
# Code spans and fenced blocks are not links: they are left out of the search.
CODE = re.compile(r"(^(?P<fence>```+|~~~+).*?^(?P=fence)[ \t]*$|`[^`\n]+`)", re.M | re.S)


def _outside(config: MkDocsConfig, page_uri: str, target: str) -> str | None:
    """The repository path that ``target``, written on page ``page_uri``, points to, if it is outside docs/."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    docs = Path(config.docs_dir).resolve()
    repo = docs.parent
    path = (docs / posixpath.dirname(page_uri) / target).resolve()
    if path.is_relative_to(docs) or not path.is_relative_to(repo) or not path.is_file():
        return None
    return path.relative_to(repo).as_posix()


def _links(markdown: str) -> list[re.Match[str]]:
    spans = [m.span() for m in CODE.finditer(markdown)]
    return [m for m in LINK.finditer(markdown) if not any(a <= m.start() < b for a, b in spans)]


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Adds under ``src/`` every repository file outside docs/ that a page links to."""
    wanted: set[str] = set()
    for file in files.documentation_pages():
        text = Path(file.abs_src_path).read_text(encoding="utf-8")
        for m in _links(text):
            path = _outside(config, file.src_uri, m["target"])
            if path is not None:
                wanted.add(path)
    repo = Path(config.docs_dir).resolve().parent
    for path in sorted(wanted):
        files.append(File.generated(config, f"{SOURCE}/{path}", abs_src_path=str(repo / path)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Rewrites each link to a repository file outside docs/ into a link to its copy under ``src/``."""
    out, last = [], 0
    for m in _links(markdown):
        path = _outside(config, page.file.src_uri, m["target"])
        if path is None:
            continue
        copy = posixpath.relpath(f"{SOURCE}/{path}", posixpath.dirname(page.file.src_uri) or ".")
        out += [markdown[last:m.start("target")], copy]
        last = m.end("target")
    return "".join(out) + markdown[last:]
