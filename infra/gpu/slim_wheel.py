"""Rewrite a wheel without some of its files, its RECORD updated to match (pip checks each installed file
against RECORD). Used for bitsandbytes, whose wheel carries a library for every CUDA and ROCm release.

    python infra/gpu/slim_wheel.py WHEEL --drop GLOB [--drop GLOB] [--keep NAME ...]
"""

from __future__ import annotations

import argparse
import fnmatch
import zipfile
from pathlib import Path, PurePosixPath


def slim(wheel: Path, drop: list[str], keep: list[str]) -> tuple[int, int]:
    """Rewrite `wheel` in place without the members matching a `drop` glob, except those named in `keep`
    (by file name). Returns (bytes before, bytes after)."""
    before = wheel.stat().st_size

    def dropped(name: str) -> bool:
        return PurePosixPath(name).name not in keep and any(fnmatch.fnmatch(name, pattern) for pattern in drop)

    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if dropped(item.filename):
                continue
            data = source.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "".join(line + "\n" for line in lines if not dropped(line.split(",", 1)[0])).encode()
            target.writestr(item, data)
    slimmed.replace(wheel)
    return before, wheel.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--drop", action="append", default=[], required=True)
    parser.add_argument("--keep", action="append", default=[])
    args = parser.parse_args()
    before, after = slim(args.wheel, args.drop, args.keep)
    print(f"slim_wheel: {args.wheel.name}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
