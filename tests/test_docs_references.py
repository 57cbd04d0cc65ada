"""Every document the code, tests and docs point at is in the repository.

The planning notes the project started from live outside it; a clone must be able to follow
every reference, so their facts are in docs/ and nothing may cite the outside files.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("proxy", "plugins", "tests", "deploy", "docs", "README.md", "CONTRIBUTING.md")
# Spelled in pieces so that this file does not match itself.
OUTSIDE_DOCS = tuple(name + ".md" for name in ("BRIEF", "DESIGN", "PERF-NOTES", "STYLE"))
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _text_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        for f in candidates:
            if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".so"):
                files.append(f)
    return files


def _markdown_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_no_file_cites_a_document_outside_the_repository() -> None:
    hits = []
    for f in _text_files():
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: images, archives
        for n, line in enumerate(text.splitlines(), start=1):
            for name in OUTSIDE_DOCS:
                if name.lower() in line.lower():
                    hits.append(f"{f.relative_to(ROOT)}:{n}: {name}")
    assert not hits, "cite the page under docs/ that holds the fact instead:\n" + "\n".join(hits)


def test_relative_markdown_links_point_at_files_that_exist() -> None:
    broken = []
    for page in _markdown_pages():
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
            for target in MARKDOWN_LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue  # a URL, mailto: or an anchor on the same page
                path = target.split("#", 1)[0]
                if not (page.parent / path).exists():
                    broken.append(f"{page.relative_to(ROOT)}:{n}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_link_checker_sees_the_links_it_checks() -> None:
    # Guards the regex: a checker that matched nothing would pass vacuously.
    targets = MARKDOWN_LINK.findall((ROOT / "docs" / "routing.md").read_text(encoding="utf-8"))
    assert "cache-capacity.md" in targets and "kv-events.md" in targets
    assert MARKDOWN_LINK.findall('see [a](b.md "title") and [c](https://x/y)') == [
        "b.md",
        "https://x/y",
    ]


DOCS_CITE = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)\b")


def _cited_docs() -> dict[str, list[str]]:
    """docs/*.md page -> where a .py file under proxy/ or plugins/ cites it."""
    cited: dict[str, list[str]] = {}
    for package in ("proxy", "plugins"):
        for f in sorted((ROOT / package).rglob("*.py")):
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), start=1):
                for page in DOCS_CITE.findall(line):
                    cited.setdefault(page, []).append(f"{f.relative_to(ROOT)}:{n}")
    return cited


def test_every_docs_page_the_code_cites_exists() -> None:
    cited = _cited_docs()
    # Guards the scan: the doctor's modules and help cite its page in several places.
    assert len(cited.get("doctor.md", [])) >= 5 and "physics.md" in cited
    missing = {page: where for page, where in cited.items() if not (ROOT / "docs" / page).exists()}
    assert not missing, "the code cites docs pages that do not exist:\n" + "\n".join(
        f"docs/{page} (cited at {', '.join(where)})" for page, where in sorted(missing.items())
    )
