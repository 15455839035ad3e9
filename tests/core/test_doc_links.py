"""Every ``docs/NAME.md#anchor`` pointer in the repository names a heading of that doc.

Comments point at docs/semantics.md and docs/kernels.md sections instead of outside documents;
this keeps those pointers from going stale when a heading is renamed.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.doc_commands import is_png

ROOT = Path(__file__).resolve().parents[2]
POINTER = re.compile(r"docs/([a-z_]+)\.md#([a-z0-9-]+)")
SCANNED = ("cache_service", "executor", "kernels", "kvcache_common", "bench", "tests", "docs",
           "scripts", "proto", "README.md")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in doc.read_text().splitlines()
            if line.startswith("#")}


def pointers() -> list[tuple[Path, str, str]]:
    found = []
    for top in SCANNED:
        base = ROOT / top
        files = [base] if base.is_file() else [p for p in base.rglob("*")
                                               if p.suffix in (".py", ".md", ".proto", ".sh")]
        for path in files:
            for doc, anchor in POINTER.findall(path.read_text(errors="replace")):
                found.append((path.relative_to(ROOT), doc, anchor))
    return found


def test_slug_rule():
    assert slug("Performance ceilings (H200)") == "performance-ceilings-h200"
    assert slug("Mamba-2 SSD") == "mamba-2-ssd"


def test_every_doc_pointer_resolves():
    found = pointers()
    assert len(found) >= 40, "the allocator and kernel comments point at docs sections"
    broken = [f"{path}: docs/{doc}.md#{anchor}" for path, doc, anchor in found
              if not (ROOT / "docs" / f"{doc}.md").is_file()
              or anchor not in anchors(ROOT / "docs" / f"{doc}.md")]
    assert not broken, "pointers to missing sections:\n" + "\n".join(broken)


def test_no_section_sign_references():
    offenders = [str(p.relative_to(ROOT)) for top in SCANNED for p in
                 ([ROOT / top] if (ROOT / top).is_file() else (ROOT / top).rglob("*"))
                 if p.is_file() and p.suffix in (".py", ".md", ".proto")
                 and "\u00a7" in p.read_text(errors="replace")]
    assert not offenders, f"section-sign references to outside documents in {offenders}"


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def test_every_image_link_names_a_small_committed_png():
    """A picture a doc shows exists beside it (relative to the doc), is a real PNG and stays
    small enough to keep in git (docs/images/, written by the benchmarks' plots)."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    links = [(doc, target) for doc in docs for target in IMAGE.findall(doc.read_text())]
    bad = []
    for doc, target in links:
        path = (doc.parent / target).resolve()
        if not path.is_file():
            bad.append(f"{doc.relative_to(ROOT)}: {target} does not exist")
        elif not is_png(path) or path.stat().st_size > 150_000:
            bad.append(f"{doc.relative_to(ROOT)}: {target} is not a PNG under 150 KB")
    assert not bad, "\n".join(bad)
