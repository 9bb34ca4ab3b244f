"""The project rule "no function over ~60 lines without a reason": every function and method in src/ciders is at
most MAX_LINES long, counted from its `def` line to its last line (decorators not counted), unless ALLOWED names it
with the reason."""

import ast
from pathlib import Path

from conftest import ROOT

SRC = ROOT / "src"
MAX_LINES = 60

# qualified name (module.function or module.Class.method) -> why it may be longer
ALLOWED = {
    "ciders.cli.parser": "a flat argparse table, one add_argument per option; splitting it would scatter the CLI "
                         "reference without making any piece simpler",
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def function_lengths(root: Path = SRC) -> list[tuple[str, int, Path, int]]:
    """(qualified name, length in lines, file, line of the `def`) of every function and method under
    root/ciders, nested ones included (qualified through their enclosing functions and classes)."""
    out: list[tuple[str, int, Path, int]] = []

    def visit(node: ast.AST, prefix: str, path: Path) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((name, child.end_lineno - child.lineno + 1, path, child.lineno))
                visit(child, name, path)
            else:
                visit(child, prefix, path)  # functions inside if / try / with blocks

    for path in sorted((root / "ciders").rglob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), _module_name(path, root), path)
    return out


def long_functions(root: Path = SRC, allowed: dict[str, str] = ALLOWED,
                   limit: int = MAX_LINES) -> list[tuple[str, int, Path, int]]:
    return [f for f in function_lengths(root) if f[1] > limit and f[0] not in allowed]


def report(offenders: list[tuple[str, int, Path, int]], root: Path = SRC, limit: int = MAX_LINES) -> str:
    lines = [f"{len(offenders)} function(s) longer than {limit} lines; split them, or add them to ALLOWED in "
             f"tests/test_function_length.py with the reason:"]
    lines += [f"  {name}: {n} lines at {path.relative_to(root.parent)}:{line}" for name, n, path, line in offenders]
    return "\n".join(lines)


def test_no_function_is_longer_than_the_limit():
    offenders = long_functions()
    assert not offenders, report(offenders)


def test_allowed_entries_are_still_needed():
    # an entry whose function was split or removed would silently allow the next long function of that name
    lengths = {name: n for name, n, _, _ in function_lengths()}
    stale = {name: lengths.get(name) for name in ALLOWED if lengths.get(name, 0) <= MAX_LINES}
    assert not stale, f"ALLOWED entries no longer over {MAX_LINES} lines (name: length, None = not found): {stale}"
    assert all(reason.strip() for reason in ALLOWED.values())


def test_the_checker_catches_a_long_function(tmp_path):
    pkg = tmp_path / "src" / "ciders"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")

    def body(n, indent="    "):  # after a def line, n - 1 body lines: n lines in all
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n - 1))

    (pkg / "small.py").write_text(
        "import functools\n\n\n"
        f"def fits():\n{body(MAX_LINES)}\n\n"
        f"def too_long():\n{body(MAX_LINES + 1)}\n\n"
        f"class K:\n    @functools.cache\n    def method(self):\n{body(MAX_LINES + 5, ' ' * 8)}\n\n"
        f"if True:\n    def hidden():\n{body(MAX_LINES + 2, ' ' * 8)}\n\n"
        f"def excused():\n{body(MAX_LINES + 10)}\n"
    )
    src = tmp_path / "src"
    lengths = {name: (n, line) for name, n, _, line in function_lengths(src)}
    assert lengths["ciders.small.fits"][0] == MAX_LINES
    assert lengths["ciders.small.too_long"][0] == MAX_LINES + 1
    assert lengths["ciders.small.K.method"][0] == MAX_LINES + 5  # the decorator line is not counted

    offenders = long_functions(src, allowed={"ciders.small.excused": "a test of the allowlist"})
    assert [name for name, *_ in offenders] == ["ciders.small.too_long", "ciders.small.K.method", "ciders.small.hidden"]
    msg = report(offenders, src)
    line = lengths["ciders.small.too_long"][1]
    where = Path("src", "ciders", "small.py")  # not a literal path: test_docs checks those resolve
    assert f"ciders.small.too_long: {MAX_LINES + 1} lines at {where}:{line}" in msg
    assert "fits" not in msg and "excused" not in msg
