"""Which build of the core this process runs: the pure-Python modules (the reference) or the
ones mypyc compiled from the same sources (``python -m cache_service.core.build``).

The compiled modules live in ``cache_service/core/_compiled/`` (never beside the sources, so
an editable install keeps running the .py files it edits), with a stamp of the sources they
were compiled from. At import, :func:`activate` puts that folder first on the package's
``__path__`` when the stamp matches the sources and this interpreter; a stale or foreign build
is ignored (pure Python, and :func:`build_info` says why). ``KVCACHE_CORE``: ``auto`` (the
default: the compiled build when it matches, else pure Python), ``pure`` (ignores any build),
``compiled`` (fails the import unless it can load). Both builds make the same decisions and
pickle to the same form (docs/architecture.md, "Compiled core").
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
COMPILED = HERE / "_compiled"
STAMP = COMPILED / "stamp.json"
#: Never compiled: the switch itself, the build and the command line; and the op and spec
#: dataclasses, whose ``ClassVar`` constants mypyc 2.4 turns into dataclass fields (off the
#: hot path: they are built once per op or per pool).
NOT_COMPILED = frozenset({"__init__", "__main__", "_variant", "build", "operations", "specs"})

_info: dict[str, Any] = {"variant": "pure", "reason": "not activated"}


def compiled_sources() -> list[Path]:
    """The modules a build compiles, in name order."""
    return sorted(p for p in HERE.glob("*.py") if p.stem not in NOT_COMPILED)


def interpreter_tag() -> str:
    return f"{sys.implementation.cache_tag}-{platform.machine()}"


def sources_digest() -> str:
    h = hashlib.sha256()
    for p in compiled_sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _why_not() -> str | None:
    """None when the compiled build matches; else why it cannot be used."""
    if not STAMP.is_file():
        return f"no compiled build ({STAMP.parent.name}/ is empty: python -m " \
            "cache_service.core.build compiles one)"
    try:
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable stamp: {exc}"
    if stamp.get("interpreter") != interpreter_tag():
        return f"built for {stamp.get('interpreter')}, this is {interpreter_tag()}"
    if stamp.get("sources") != sources_digest():
        return "stale: the sources changed since the build (python -m cache_service.core.build)"
    return None


def activate(package_path: list[str]) -> dict[str, Any]:
    """Chooses the build (see the module docstring) before any core module is imported."""
    global _info
    wanted = os.environ.get("KVCACHE_CORE", "auto")
    if wanted not in ("auto", "pure", "compiled"):
        raise ImportError(f"KVCACHE_CORE must be auto, pure or compiled, not {wanted!r}")
    why = "KVCACHE_CORE=pure" if wanted == "pure" else _why_not()
    if why is None:
        package_path.insert(0, str(COMPILED / "cache_service" / "core"))
        if str(COMPILED) not in sys.path:
            sys.path.append(str(COMPILED))  # mypyc's shared runtime module lives there
        _info = {"variant": "compiled", "reason": "stamp matches the sources",
                 "modules": [p.stem for p in compiled_sources()]}
    elif wanted == "compiled":
        raise ImportError(f"KVCACHE_CORE=compiled but {why}")
    else:
        _info = {"variant": "pure", "reason": why}
    return _info


def build_info() -> dict[str, Any]:
    """The variant this process runs and why, plus what each core module was loaded from."""
    loaded = {name.rsplit(".", 1)[1]: getattr(mod, "__file__", None) or ""
              for name, mod in list(sys.modules.items())
              if name.startswith("cache_service.core.") and name.count(".") == 2}
    compiled = sorted(k for k, f in loaded.items() if f.endswith((".so", ".pyd")))
    return {**_info, "interpreter": interpreter_tag(), "compiled_modules_loaded": compiled}
