"""Every implementation a doc names exists: the docs' **Code.** paragraphs say where each equation and decision
lives (`name` in `path`), and a rename that leaves them pointing nowhere fails here."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
PATH = re.compile(r"`((?:src|benchmarks|tests|configs)/[^`]+)`")


def code_paragraphs(text: str) -> list[str]:
    """The paragraphs that start with **Code.**, joined into one line each."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        i = para.find("**Code.**")
        if i >= 0:
            out.append(" ".join(para[i:].split()))
    return out


def claims(para: str) -> list[tuple[list[str], str]]:
    """([names], path) for each clause `a`, `b` and `c` ... in `path`: the names a clause gives before a path
    (`a` in `p1`, `p2` and `p3`: in each). Parenthesised asides are prose (math such as `p_i`, arguments such as
    `kind="fd"`) and are skipped."""
    para = re.sub(r"\([^()]*\)", "", para)
    out, names, last_end = [], [], None
    for m in re.finditer(r"`([^`]+)`", para):
        tok = m.group(1)
        if PATH.fullmatch(f"`{tok}`"):
            listed = last_end is not None and re.fullmatch(r"[\s,]*(and|or)?\s*", para[last_end:m.start()])
            if not names and listed and out:
                names = out[-1][0]  # `a` in `p1`, `p2`: in p2 as well
            out.append((names, tok))
            names, last_end = [], m.end()
        elif IDENT.match(tok):
            names.append(tok)
            last_end = None
    return out


def _attr(obj, dotted: str):
    for part in dotted.split("."):
        fields = getattr(obj, "__dataclass_fields__", {})
        obj = fields[part] if part in fields and not hasattr(obj, part) else getattr(obj, part)
    return obj


def missing(names: list[str], path: str) -> list[str]:
    """The names that neither the module at `path` nor a class named in the same clause defines."""
    if not path.endswith(".py") or not path.startswith("src/"):
        return [] if (ROOT / path.rstrip("/")).exists() else [f"(the file {path})"]
    module = importlib.import_module(path[len("src/"):-len(".py")].replace("/", ".").removesuffix(".__init__"))
    # `Cls`, `Cls.method`, then `other`: a bare name may be a method of a class the clause named
    classes = [getattr(module, n.split(".")[0]) for n in names
               if isinstance(getattr(module, n.split(".")[0], None), type)]
    bad = []
    for n in names:
        owners = [module] + classes
        if not any(_has(o, n) for o in owners):
            bad.append(n)
    return bad


def _has(owner, dotted: str) -> bool:
    try:
        _attr(owner, dotted)
        return True
    except (AttributeError, KeyError):
        return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_implementation_a_doc_names_exists(doc):
    bad = []
    for para in code_paragraphs(doc.read_text(encoding="utf-8")):
        for names, path in claims(para):
            bad += [f"`{n}` in `{path}`" for n in missing(names, path)]
    assert not bad, f"{doc.name} names implementations that do not exist: {', '.join(bad)}"


def test_the_check_finds_a_renamed_function():
    para = ("**Code.** `server_update` and `no_such_update` in `src/ciders/algorithms/ciders.py`; `Coordinator.aggregate` "
            "and `takd` in `src/ciders/federation/rounds.py`; `configure` in `src/ciders/algorithms/fedavg.py` and "
            "`src/ciders/algorithms/dist_maml.py`")
    assert [missing(n, p) for n, p in claims(para)] == [["no_such_update"], ["takd"], [], ["configure"]]
