#!/usr/bin/env python
"""Writes build/torch-<backend>/ from torch-ext/ and build.toml, as kernel-builder does for a
`torch-noarch` kernel: the Python package and a metadata.json per backend. The package is a symbolic
link to torch-ext/ (git keeps one source tree; `kernels` imports through the link).

    python kernels/dflash-kernels/build_variants.py          # rewrite build/
    python kernels/dflash-kernels/build_variants.py --check  # exit 1 if build/ is stale

The variant keeps the package in `dflash_kernels/` (the layout every `kernels` release loads);
kernel-builder >= 0.17 flattens it into the variant folder, which `kernels` loads as well.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def _sources(package_dir: Path) -> dict[str, bytes]:
    return {
        path.relative_to(package_dir).as_posix(): path.read_bytes()
        for path in sorted(package_dir.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def expected_tree() -> dict[str, bytes]:
    """Relative path under build/ -> file contents."""
    config = tomllib.loads((ROOT / "build.toml").read_text())["general"]
    module = config["name"].replace("-", "_")
    sources = _sources(ROOT / "torch-ext" / module)
    # A content hash stands in for kernel-builder's git revision: unique per source revision, so two
    # revisions loaded in one process never share a module name (metadata `id` is the module name).
    digest = hashlib.sha256(b"".join(name.encode() + data for name, data in sources.items())).hexdigest()[:7]
    tree = {}
    for backend in config["backends"]:
        variant = f"torch-{backend}"
        metadata = {
            "name": config["name"],
            "id": f"_{module}_{backend}_{digest}",
            "version": config["version"],
            "license": config["license"],
            "python-depends": [],
            "backend": {"type": backend},
        }
        tree[f"{variant}/metadata.json"] = (json.dumps(metadata, indent=2) + "\n").encode()
        tree[f"{variant}/{module}"] = LINK_PREFIX + f"../../torch-ext/{module}".encode()
    return tree


LINK_PREFIX = b"symlink:"  # marks tree entries that are symbolic links (the bytes after it: the target)


def _present(path: Path) -> bytes | None:
    if path.is_symlink():
        return LINK_PREFIX + os.readlink(path).encode()
    return path.read_bytes() if path.is_file() else None


def stale_files() -> list[str]:
    build = ROOT / "build"
    tree = expected_tree()
    present = set()
    if build.is_dir():
        for variant in build.iterdir():
            present.update(p.relative_to(build).as_posix() for p in variant.iterdir())
    changed = [name for name, data in tree.items() if _present(build / name) != data]
    return sorted(changed + sorted(present - tree.keys()))


def write() -> None:
    build = ROOT / "build"
    shutil.rmtree(build, ignore_errors=True)
    for name, data in expected_tree().items():
        (build / name).parent.mkdir(parents=True, exist_ok=True)
        if data.startswith(LINK_PREFIX):
            (build / name).symlink_to(data[len(LINK_PREFIX):].decode(), target_is_directory=True)
        else:
            (build / name).write_bytes(data)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether build/ is up to date")
    if parser.parse_args().check:
        stale = stale_files()
        print("build/ is up to date" if not stale else "build/ is stale: " + ", ".join(stale))
        sys.exit(1 if stale else 0)
    write()
    print(f"wrote {ROOT / 'build'}")
