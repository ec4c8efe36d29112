"""Build the wheel bundle `make gpu-check` needs on a GPU machine without a package index: the packages the
GPU image lacks (see docs/benchmarks-method.md), for its Python (3.12, manylinux x86_64), unpacked into one
site folder with Ray's unused parts left out, as one .tar.xz under the 64 MiB a device call carries.

    .venv/bin/python benchmarks/gpu_bundle.py --out build/gpu-bundle.tar.xz
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# What the GPU image (torch with CUDA, transformers, accelerate, safetensors, tokenizers, pandas, pyarrow,
# tensorboard, rich, matplotlib, pytest, peft) does not have, with their own needs it lacks too.
PACKAGES = [
    "ray==2.60.0",
    "omegaconf==2.4.0",
    "antlr4-python3-runtime==4.13.2",
    "math-verify",
    "latex2sympy2_extended",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "attrs",
    "msgpack",
    "click",
    "datasets",
    "dill",
    "xxhash",
    "multiprocess",
    "fsspec",
    "aiohttp",
    "aiohappyeyeballs",
    "aiosignal",
    "frozenlist",
    "multidict",
    "propcache",
    "yarl",
]
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"]
# Ray's parts posttrain never imports: its libraries, the Java jars and the dashboard's web client.
RAY_UNUSED = ["rllib", "data", "serve", "train", "tune", "llm", "jars", "dashboard/client/build"]
LIMIT_BYTES = 64 * 1024**2


def download(wheels: Path, python_version: str) -> None:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", python_version, *platforms, "-d", str(wheels), *PACKAGES]
    subprocess.run(command, check=True)


def unpack(wheels: Path, site: Path) -> None:
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    for part in RAY_UNUSED:
        shutil.rmtree(site / "ray" / part, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/gpu-bundle.tar.xz", help="the bundle to write")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    args = parser.parse_args(argv)
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="gpu_bundle_") as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        download(wheels, args.python_version)
        unpack(wheels, site)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz") as bundle:
            bundle.add(site, arcname=".")
    size = out.stat().st_size
    print(f"wrote {out}: {size / 1024**2:.1f} MiB ({len(PACKAGES)} packages)")
    if size > LIMIT_BYTES:
        print(f"the bundle is over the {LIMIT_BYTES // 1024**2} MiB a device call carries", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
