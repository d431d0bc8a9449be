"""Print this project's requirements for an image, with some distributions cut out of the tree.

Why: pip has no way to leave one dependency of a dependency out. LlamaFactory requires torchaudio and
imports it at module import (llamafactory/data/mm_plugin.py), but text SFT never calls it; NVIDIA's
PyTorch image may ship no torchaudio, and PyPI's torchaudio pins a PyPI torch that would replace the
image's CUDA build. So train.Dockerfile installs LlamaFactory with --no-deps first, and this script
then lists what pip should install: the project's dependencies and extra, where every *installed*
requirement that needs a cut distribution is replaced by its own requirements minus the cut ones.
Runs on the image's Python before the project is installed (stdlib and `packaging` only).

    python infra/images/requirements_without.py --pin llamafactory            # llamafactory==0.9.5
    python infra/images/requirements_without.py --extra gpu-train --without torchaudio
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # an image without `packaging`: pip's vendored copy is the same library
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]


def project_requirements(pyproject: Path, extra: str | None) -> list[Requirement]:
    """The project's dependencies plus one extra, its references to the project's own extras expanded."""
    project = tomllib.loads(pyproject.read_text())["project"]
    name = canonicalize_name(project["name"])
    extras = project.get("optional-dependencies", {})
    if extra is not None and extra not in extras:
        raise SystemExit(f"{pyproject}: no extra {extra!r} in [project.optional-dependencies]")
    pending = [*project.get("dependencies", []), *(extras[extra] if extra else [])]
    found: list[Requirement] = []
    while pending:
        requirement = Requirement(pending.pop(0))
        if canonicalize_name(requirement.name) == name:
            pending += [r for e in sorted(requirement.extras) for r in extras[e]]
        elif requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            found.append(requirement)
    return found


def installed_requirements(requirement: Requirement) -> list[Requirement] | None:
    """What an installed distribution requires (markers evaluated for the extras asked of it); None when it
    is not installed."""
    try:
        declared = metadata.requires(requirement.name) or []
    except metadata.PackageNotFoundError:
        return None
    wanted = [""] + sorted(requirement.extras)
    parsed = [Requirement(text) for text in declared]
    return [r for r in parsed if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in wanted)]


def without(requirements: list[Requirement], cut: set[str]) -> list[str]:
    """Requirement lines for pip: each installed requirement that needs a cut distribution is replaced by
    its own requirements minus the cut ones (it must already be installed, with --no-deps)."""
    lines: list[str] = []
    for requirement in requirements:
        needs = installed_requirements(requirement)
        if needs is not None and any(canonicalize_name(r.name) in cut for r in needs):
            lines += [str(r) for r in needs if canonicalize_name(r.name) not in cut]
        elif canonicalize_name(requirement.name) not in cut:
            lines.append(str(requirement))
    return list(dict.fromkeys(lines))


def pin(requirements: list[Requirement], name: str) -> str:
    for requirement in requirements:
        if canonicalize_name(requirement.name) == canonicalize_name(name):
            return str(requirement)
    raise SystemExit(f"pyproject.toml: {name} is not among the requirements")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--extra", help="one of [project.optional-dependencies]")
    parser.add_argument("--without", action="append", default=[], help="a distribution to cut (repeatable)")
    parser.add_argument("--pin", metavar="NAME", help="print only the project's requirement on NAME")
    args = parser.parse_args(argv)
    requirements = project_requirements(args.pyproject, args.extra)
    if args.pin:
        print(pin(requirements, args.pin))
        return
    cut = {canonicalize_name(name) for name in args.without}
    sys.stdout.write("".join(f"{line}\n" for line in without(requirements, cut)))


if __name__ == "__main__":
    main()
