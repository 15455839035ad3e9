"""Print the project's third-party requirements, one per line, read from pyproject.toml.

Used by wheelhouse.sh (what to put in the wheelhouse) and by the Dockerfile (what to install
before the project itself, so that the dependency layers stay cached while the source changes):
one list, so the two cannot drift.

    python3 requirements.py PYPROJECT [--extra NAME] [--torch-spec SPEC] [--build-system]
"""

from __future__ import annotations

import argparse
import re
import tomllib
from typing import Any


def _name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement string, lower-cased."""
    match = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    if match is None:
        raise SystemExit(f"requirements.py: not a requirement: {requirement!r}")
    return match.group().lower()


def _extras(project: dict[str, Any], extras: list[str], seen: set[str]) -> list[str]:
    """The requirements of ``extras``, an extra that names the project itself
    (``kvcache-service[a,b]``) expanded to the extras it lists."""
    own = project["name"].lower()
    reqs: list[str] = []
    for extra in extras:
        if extra in seen:
            continue
        seen.add(extra)
        try:
            listed = project["optional-dependencies"][extra]
        except KeyError:
            raise SystemExit(
                f"requirements.py: --extra {extra!r}: no such extra in pyproject") from None
        for req in listed:
            if _name(req) == own:
                reqs += _extras(project, re.findall(r"[A-Za-z0-9._-]+", req.split("[", 1)[1]), seen)
            else:
                reqs.append(req)
    return reqs


def requirements(pyproject: dict, extras: list[str], torch_spec: str | None,
                 build_system: bool) -> list[str]:
    """Base dependencies, plus each extra's, plus the build backend if asked. A ``torch``
    requirement is replaced by ``torch_spec`` when given (a range could pull a CUDA build)."""
    project = pyproject["project"]
    reqs = list(project["dependencies"])
    reqs += _extras(project, extras, set())
    if torch_spec:
        reqs = [r for r in reqs if _name(r) != "torch"]
        if "executor" in extras:
            reqs.append(torch_spec)
    if build_system:
        reqs += pyproject["build-system"]["requires"]
    return sorted(set(reqs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject")
    parser.add_argument("--extra", action="append", default=[])
    parser.add_argument("--torch-spec", default=None)
    parser.add_argument("--build-system", action="store_true")
    args = parser.parse_args()
    with open(args.pyproject, "rb") as f:
        meta = tomllib.load(f)
    print("\n".join(requirements(meta, args.extra, args.torch_spec, args.build_system)))


if __name__ == "__main__":
    main()
