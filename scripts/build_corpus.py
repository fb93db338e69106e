"""Rebuild ``lightning_megatron/data/corpus/`` from a local copy of *The Rust Programming Language*.

The book ships with every ``rustup`` toolchain that has the ``rust-docs`` component, under
``<toolchain>/share/doc/rust/html/book/``.  This script keeps only the prose of the main
chapters (paragraphs, headings, list items, block quotes, with inline code kept as plain
text), drops code listings, figures, tables, scripts and navigation, turns curly quotes
into ASCII quotes, and writes one UTF-8 text file per chapter.  It only reads local files; nothing is downloaded.

Usage::

    python scripts/build_corpus.py [BOOK_HTML_DIR] [OUT_DIR]
"""

from __future__ import annotations

import html
import re
import sys
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

DEFAULT_BOOK = Path.home() / ".rustup/toolchains/stable-x86_64-unknown-linux-gnu/share/doc/rust/html/book"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "lightning_megatron/data/corpus"

SKIP = {"pre", "script", "style", "figure", "table", "nav", "svg", "button", "template", "img", "sup"}
BLOCK = {"p", "li", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "div", "section", "ul", "ol", "dd", "dt"}
_TYPOGRAPHY = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})
VOID = {"br", "hr", "img", "input", "meta", "link", "source", "wbr"}


class _ProseExtractor(HTMLParser):
    """Collects the paragraphs of prose inside ``<main>``, skipping code and other non-prose."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.in_main = False
        self.skip_depth = 0
        self.buf: list[str] = []
        self.paragraphs: list[str] = []

    def _flush(self) -> None:
        text = re.sub(r"\s+", " ", "".join(self.buf)).strip()
        self.buf = []
        if text:
            self.paragraphs.append(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "main":
            self.in_main = True
            return
        if not self.in_main or tag in VOID:
            return
        if self.skip_depth or tag in SKIP:
            self.skip_depth += 1
            return
        if tag in BLOCK:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if tag == "main":
            self._flush()
            self.in_main = False
            return
        if not self.in_main or tag in VOID:
            return
        if self.skip_depth:
            self.skip_depth -= 1
            return
        if tag in BLOCK:
            self._flush()

    def handle_data(self, data: str) -> None:
        if self.in_main and not self.skip_depth:
            self.buf.append(data)


def extract(path: Path) -> list[str]:
    """Return the prose paragraphs of one mdBook chapter page."""
    parser = _ProseExtractor()
    parser.feed(path.read_text(encoding="utf-8"))
    parser.close()
    paragraphs = []
    for p in parser.paragraphs:
        p = html.unescape(p).translate(_TYPOGRAPHY).replace("↩", "").strip()
        # Drop lone symbols and the "Filename: src/main.rs" labels of the (removed) listings.
        if len(p) > 1 and not p.startswith("Filename:"):
            paragraphs.append(p)
    return paragraphs


def main() -> None:
    """Extract the chapters and write ``chNN.txt`` files into the corpus directory."""
    book = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_BOOK
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    chapters: dict[str, list[Path]] = defaultdict(list)
    chapters["ch00"].append(book / "foreword.html")
    for page in sorted(book.glob("ch[0-9][0-9]-[0-9][0-9]-*.html")):
        if "<main" not in page.read_text(encoding="utf-8"):
            continue  # redirect stub left over from an older chapter layout
        chapters[page.name[:4]].append(page)
    total = 0
    for chapter, pages in sorted(chapters.items()):
        paragraphs = [p for page in pages for p in extract(page)]
        text = "\n\n".join(paragraphs) + "\n"
        (out / f"{chapter}.txt").write_text(text, encoding="utf-8")
        total += len(text.encode("utf-8"))
        print(f"{chapter}: {len(pages)} pages, {len(text.encode('utf-8'))} bytes")
    print(f"total: {total} bytes")


if __name__ == "__main__":
    main()
