"""Compiles the core with mypyc (which ships with mypy) into ``cache_service/core/_compiled/``:
``python -m cache_service.core.build``. Opt-in: without it the core runs as pure Python.

The same sources, unchanged, become C extension modules with the same API and the same
decisions (CI runs tests/core and the replay conformance against both builds). The build is
written beside the package, not beside the sources, with a stamp of the sources and the
interpreter (:mod:`cache_service.core._variant` loads it only while both match), so editing
a module falls back to pure Python until the next build. Needs a C compiler and the
interpreter's headers; about a minute on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from cache_service.core import _variant


def build(opt_level: str = "2", jobs: int | None = None, quiet: bool = True) -> dict[str, object]:
    """Compiles every module of :func:`_variant.compiled_sources` and installs the result
    (replacing an earlier build only once the new one is complete)."""
    from mypyc.build import mypycify  # noqa: PLC0415 (mypy is a build-time tool here)
    from setuptools import Distribution  # noqa: PLC0415

    root = _variant.HERE.parents[1]  # mypyc names modules by their path from the root
    sources = [str(p.relative_to(root)) for p in _variant.compiled_sources()]
    digest = _variant.sources_digest()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcache-mypyc-") as tmp:
        cwd = os.getcwd()
        os.chdir(root)
        try:
            extensions = mypycify(sources, opt_level=opt_level, multi_file=True,
                                  target_dir=str(Path(tmp) / "c"), verbose=not quiet)
            dist = Distribution({"name": "kvcache-core-compiled", "ext_modules": extensions})
            cmd = dist.get_command_obj("build_ext")
            cmd.build_lib = str(Path(tmp) / "lib")
            cmd.build_temp = str(Path(tmp) / "tmp")
            cmd.parallel = jobs or os.cpu_count() or 1
            cmd.ensure_finalized()
            cmd.run()
        finally:
            os.chdir(cwd)
        staged = Path(tmp) / "lib"
        stamp = {"sources": digest, "interpreter": _variant.interpreter_tag(),
                 "modules": [Path(s).stem for s in sources], "opt_level": opt_level,
                 "seconds": round(time.perf_counter() - t0, 1)}
        (staged / "stamp.json").write_text(json.dumps(stamp, indent=1) + "\n")
        old = _variant.COMPILED.with_name("_compiled.old")
        shutil.rmtree(old, ignore_errors=True)
        if _variant.COMPILED.exists():
            _variant.COMPILED.rename(old)
        shutil.copytree(staged, _variant.COMPILED)
        shutil.rmtree(old, ignore_errors=True)
    return stamp


def clean() -> bool:
    """Removes the compiled build; True if there was one."""
    if not _variant.COMPILED.exists():
        return False
    shutil.rmtree(_variant.COMPILED)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cache_service.core.build",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--opt-level", default="2", choices=("0", "1", "2", "3"),
                   help="the C compiler's optimization level (default 2)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiler jobs")
    p.add_argument("--clean", action="store_true", help="remove the compiled build instead")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.clean:
        print("removed the compiled build" if clean() else "no compiled build to remove")
        return 0
    try:
        stamp = build(args.opt_level, args.jobs, quiet=not args.verbose)
    except Exception as exc:  # a missing compiler or header: say so, keep pure Python
        print(f"compiling the core failed, it stays pure Python: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"built": str(_variant.COMPILED), **stamp}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
