"""The repository explains itself: every relative link and every `docs/...` or `src/ciders/...` reference in
its files resolves, markdown anchors exist, and nothing points at files outside the repository."""

import re
import subprocess

import pytest

from conftest import ROOT

TEXT = (".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".sh", "Makefile", "run")


def repo_files() -> list:
    """Tracked and untracked-but-not-ignored files (what a clone holds)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file() and p.endswith(TEXT) and not p.startswith("tests/fixtures/")
            and p != "tests/test_docs.py"]


def anchors(md_text: str) -> set:
    """GitHub-style heading anchors of a markdown file."""
    out = set()
    for line in md_text.splitlines():
        m = re.match(r"^#{1,6}\s+(.*)", line)
        if m:
            a = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(a)
    return out


LINK = re.compile(r"\]\(([^)\s]+)\)")
REF = re.compile(r"(?<![\w/.-])((?:docs|src/ciders|configs|benchmarks|tests|data)/[\w./-]*[\w/])")
OUTSIDE = re.compile(r"\.\./shared|SPEC\.md|\bSPEC \d|\bSPEC Part|ciders-paper\.txt|rabo-paper\.txt|rabo-summary\.txt|"
                     r"\bstack\.md|docs/install\.md")


def broken_references(files) -> list:
    bad = []
    for f in files:
        text = f.read_text(errors="replace")
        rel = f.relative_to(ROOT)
        for m in OUTSIDE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            bad.append(f"{rel}:{line}: points outside the repository ({m.group(0)})")
        if f.suffix == ".md":
            for target in LINK.findall(text):
                if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (f.parent / path).resolve() if path else f
                if not dest.exists():
                    bad.append(f"{rel}: link to {target} does not resolve")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                    bad.append(f"{rel}: link to {target}: no such heading")
        for m in REF.finditer(text):
            ref = m.group(1).rstrip(".")
            if "*" in ref or "<" in ref or text[m.end():m.end() + 1] in ("{", "*", "<"):
                continue  # a pattern (configs/paper/rabo_*.yaml), not a path
            if not (ROOT / ref).exists():
                line = text[: m.start()].count("\n") + 1
                bad.append(f"{rel}:{line}: {ref} does not exist")
    return bad


def test_every_reference_in_the_repository_resolves():
    assert broken_references(repo_files()) == []


def test_the_checker_finds_broken_links_missing_anchors_and_outside_paths():
    probe = ROOT / "docs" / ".probe-check.md"  # removed at once; inside the repo so paths resolve from it
    probe.write_text("[a](missing.md) [b](#nowhere) [c](architecture.md#a-round)\n"
                     "see ../shared/SPEC.md, SPEC 1.3 and docs/nope.md; docs/method.md is fine\n# A heading\n")
    try:
        found = broken_references([probe])
    finally:
        probe.unlink()
    assert any("missing.md" in b for b in found) and any("#nowhere" in b for b in found)
    assert any("../shared" in b for b in found) and any("SPEC 1" in b for b in found)
    assert any("docs/nope.md" in b for b in found)
    assert not any("architecture.md" in b or "docs/method.md" in b for b in found)
    assert broken_references([ROOT / "docs" / "architecture.md"]) == []


@pytest.mark.parametrize("doc", ["README.md", "docs/method.md", "docs/rabo.md", "docs/architecture.md",
                                 "docs/flower.md"])
def test_the_main_documents_exist(doc):
    assert (ROOT / doc).is_file()
