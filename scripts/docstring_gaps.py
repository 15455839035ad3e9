"""Counts the public functions and methods without a docstring.

    python3 scripts/docstring_gaps.py            # the count, then the files with most gaps
    python3 scripts/docstring_gaps.py --list     # every gap, as path:line name

Public: a function or method whose name does not start with ``_``, at module level or in a
class whose name does not either (nested functions are not counted). The tree is the
package code (``ROOTS``), generated protobuf modules aside. ``tests/test_docstring_gaps.py``
keeps the count under a ceiling.
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

ROOTS = ("cache_service", "kvcache_common", "executor", "kernels", "bench")
REPO = Path(__file__).resolve().parent.parent


def public_functions(path: Path) -> list[tuple[int, str, bool]]:
    """(line, qualified name, has a docstring) of each public function in ``path``."""
    out: list[tuple[int, str, bool]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                if not child.name.startswith("_"):
                    out.append((child.lineno, prefix + child.name,
                                ast.get_docstring(child) is not None))
            elif isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(path.read_text(), str(path)), "")
    return out


def sources(repo: Path = REPO, roots: tuple[str, ...] = ROOTS) -> list[Path]:
    """The Python files counted, sorted (generated ``*_pb2*.py`` aside)."""
    return sorted(p for root in roots for p in (repo / root).rglob("*.py")
                  if "_pb2" not in p.name)


def gaps(repo: Path = REPO, roots: tuple[str, ...] = ROOTS) -> tuple[int, list[str]]:
    """(how many public functions there are, ``path:line name`` of those without a
    docstring)."""
    total, missing = 0, []
    for path in sources(repo, roots):
        for line, name, documented in public_functions(path):
            total += 1
            if not documented:
                missing.append(f"{path.relative_to(repo)}:{line} {name}")
    return total, missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print every gap")
    parser.add_argument("roots", nargs="*", default=list(ROOTS),
                        help=f"folders to count (default: {' '.join(ROOTS)})")
    args = parser.parse_args()
    total, missing = gaps(REPO, tuple(args.roots))
    print(f"{len(missing)} of {total} public functions have no docstring")
    if args.list:
        print("\n".join(missing))
    else:
        for path, n in Counter(m.split(":")[0] for m in missing).most_common(10):
            print(f"{n:4d} {path}")


if __name__ == "__main__":
    main()
