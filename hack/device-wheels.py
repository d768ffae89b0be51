#!/usr/bin/env python3
"""Gather the wheels a GPU machine without a registry needs to run tests/gpu and bench/: the
named requirements and what they need, minus what that machine's image already holds
(--have, a file of distribution names, one per line or comma-separated). Python 3.12, x86-64
manylinux wheels, into --dest (default .whl/, which bench/device_env.sh installs from).

    python3 hack/device-wheels.py --have have.txt openai fastapi uvicorn xgrammar guidellm==0.8.1
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any"]
ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def download(req: str, dest: Path) -> Path:
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), req]
    for p in PLATFORMS:
        cmd[-1:-1] = ["--platform", p]
    subprocess.run(cmd, check=True)
    new = set(dest.glob("*.whl")) - before
    name = canonicalize_name(Requirement(req).name)
    hits = [w for w in (new or dest.glob("*.whl")) if canonicalize_name(w.name.split("-")[0]) == name]
    if not hits:
        raise SystemExit(f"device-wheels: pip saved no wheel for {req}")
    return hits[0]


def requires(wheel: Path, extras: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in re.findall(r"^Requires-Dist: (.+)$", text, re.M):
        r = Requirement(line)
        if r.marker is None or any(r.marker.evaluate({**ENV, "extra": e}) for e in extras | {""}):
            out.append(r)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("requirements", nargs="+")
    ap.add_argument("--have", type=Path, required=True)
    ap.add_argument("--dest", type=Path, default=Path(".whl"))
    ap.add_argument("--skip", default="torch,triton", help="names never carried (the image's own)")
    a = ap.parse_args()
    have = {canonicalize_name(n) for n in re.split(r"[\s,]+", a.have.read_text()) if n}
    have |= {canonicalize_name(n) for n in a.skip.split(",") if n}
    a.dest.mkdir(parents=True, exist_ok=True)
    queue = [Requirement(r) for r in a.requirements]
    seen: set[str] = set()
    extras_seen: set[tuple[str, str]] = set()
    while queue:
        r = queue.pop(0)
        name = canonicalize_name(r.name)
        if name in have:
            # the image holds the package, not necessarily its extras' needs (httpx[http2] -> h2)
            new = {e for e in r.extras if (name, e) not in extras_seen}
            if new:
                extras_seen |= {(name, e) for e in new}
                with tempfile.TemporaryDirectory() as tmp:
                    meta = download(r.name, Path(tmp))
                    base = {str(q) for q in requires(meta, set())}
                    queue += [q for q in requires(meta, new) if str(q) not in base]
            continue
        if name in seen:
            continue
        seen.add(name)
        wheel = download(f"{r.name}{r.specifier}", a.dest)
        print(f"device-wheels: {wheel.name}")
        queue += requires(wheel, set(r.extras))
    total = sum(w.stat().st_size for w in a.dest.glob("*.whl")) / 2**20
    print(f"device-wheels: {len(seen)} wheels, {total:.1f} MiB in {a.dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
