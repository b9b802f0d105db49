"""Pack torch 2.13 (CUDA 13.0 build) and triton 3.7.1 for a lent H200 machine whose own torch is older.

The lent machines carry torch 2.11 (sac2 needs 2.13 or newer) with CUDA 13.0 libraries, reach no package registry,
and take at most 64 MiB of files per call. This script packs torch and triton for Python 3.12 on x86-64, for Hopper
(sm_90) only, into parts that fit, each in an ignored folder ``.gpu0`` ... ``.gpuN`` of the checkout:

- the CUDA kernels torch carries for other GPUs are zeroed (every fatbin entry whose arch is not sm_90), so they
  pack to nothing: 1.6 GB unpacked, 0.26 GB packed, four parts;
- triton's profiler, its Blackwell assembler and its CUPTI copy are left out;
- the NCCL entry points torch 2.13 links but the machine's NCCL 2.28.9 lacks get stubs (``libncclstub.so``, put in
  ``LD_PRELOAD``): one GPU never calls them.

Send part K in call K (``carry`` ``.gpuK``, command ``mkdir -p /tmp/p && cp .gpuK/part.K /tmp/p/``), one call right
after the other (a machine idle for 30 s is given back, and the parts with it); the last call's command is
``bash .gpuN/run.sh``, which joins and unpacks the parts (about 15 s) and runs ``benchmarks/gpu_all.sh`` into $OUT.
Needs pip, readelf, nm, gcc and xz here; about 8 minutes on 2 cores, most of it xz.

    python benchmarks/gpu_bundle.py            # then add /.gpu*/ to .git/info/exclude
"""

from __future__ import annotations

import hashlib
import mmap
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

__all__ = ["main", "zero_other_archs"]

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/sac2-gpu-bundle")
WHEELS = ("torch==2.13.0", "triton==3.7.1", "nvidia-nccl-cu13==2.28.9")  # NCCL: the machine's, to diff against
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_18_x86_64", "manylinux_2_17_x86_64")
LEAVE_OUT = ("triton/backends/nvidia/lib/cupti", "triton/backends/nvidia/bin/ptxas-blackwell",
             "triton/instrumentation", "triton/_C/libproton.so", "torch/bin/protoc", "torch/bin/protoc-3.13.0.0")
KEEP_ARCH = 90
PART_BYTES = 62 * 2**20  # under 64 MiB with the checkout (1.4 MB) and the stub beside it
_FATBIN_MAGIC = 0xBA55ED50


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def _fatbin_section(path: Path) -> tuple[int, int] | None:
    """(file offset, size) of the library's ``.nv_fatbin`` section, or None."""
    for line in _run("readelf", "-S", "-W", str(path)).splitlines():
        if " .nv_fatbin " in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    return None


def zero_other_archs(path: Path, keep: int = KEEP_ARCH) -> int:
    """Zero the payload of every fatbin entry of ``path`` built for another arch than ``keep``; the bytes zeroed.

    A fatbin is a sequence of containers (magic, version, header size, payload size), each a sequence of entries
    (kind, header size, payload size, ..., arch at byte 28). The driver picks the entry of the GPU's own arch, so the
    others are never read on that GPU.
    """
    section = _fatbin_section(path)
    if section is None:
        return 0
    start, size = section
    zeroed = 0
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as buf:
        p = start
        while p < start + size:
            magic, _, header, body = struct.unpack_from("<IHHQ", buf, p)
            if magic != _FATBIN_MAGIC:
                p += 8  # containers are 8-byte aligned
                continue
            q, end = p + header, p + header + body
            while q < end:
                _, _, entry_header, payload = struct.unpack_from("<HHIQ", buf, q)
                arch = struct.unpack_from("<I", buf, q + 28)[0]
                if arch != keep:
                    buf[q + entry_header:q + entry_header + payload] = bytes(payload)
                    zeroed += payload
                q += entry_header + payload
            p = end
    return zeroed


def _download() -> Path:
    wheels = WORK / "wheels"
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels), *WHEELS],
                   check=True)
    return wheels


def _unzip(wheel: Path, into: Path) -> None:
    """Extract ``wheel`` keeping each file's mode (zipfile drops it; triton's ptxas must stay executable)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = Path(z.extract(info, into))
            mode = info.external_attr >> 16
            if mode and not info.is_dir():
                path.chmod(mode & 0o777)


def _site(wheels: Path) -> Path:
    site = WORK / "site"
    shutil.rmtree(site, ignore_errors=True)
    for wheel in sorted(wheels.glob("*.whl")):
        if not wheel.name.startswith("nvidia_nccl"):
            _unzip(wheel, site)
    for relative in LEAVE_OUT:
        target = site / relative
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    for library in sorted((site / "torch" / "lib").glob("*.so")):
        zeroed = zero_other_archs(library)
        if zeroed:
            print(f"{library.name}: {zeroed / 2**20:.0f} MiB of other GPUs' kernels zeroed")
    return site


def _nccl_stub(wheels: Path, site: Path, out: Path) -> None:
    """A library defining, as stubs returning ncclInvalidUsage, the NCCL functions torch links but the machine's
    NCCL lacks."""
    (nccl_wheel,) = wheels.glob("nvidia_nccl*.whl")
    with zipfile.ZipFile(nccl_wheel) as z:
        z.extract("nvidia/nccl/lib/libnccl.so.2", WORK)
    defined = _run("nm", "-D", "--defined-only", str(WORK / "nvidia/nccl/lib/libnccl.so.2"))
    undefined = _run("nm", "-D", "--undefined-only", *map(str, (site / "torch/lib").glob("*.so")))
    have = {line.split()[-1] for line in defined.splitlines() if line.strip()}
    need = {line.split()[-1] for line in undefined.splitlines() if line.split() and line.split()[-1].startswith("nccl")}
    missing = sorted(need - have)
    print(f"NCCL stubs: {', '.join(missing) or 'none'}")
    source = WORK / "ncclstub.c"
    source.write_text("".join(f"int {name}(void) {{ return 5; }}\n" for name in missing))  # 5: ncclInvalidUsage
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(out / "libncclstub.so"), str(source)], check=True)


_RUN_SH = """#!/usr/bin/env bash
# Made by benchmarks/gpu_bundle.py: join the parts sent before, unpack torch and triton beside the machine's own,
# run the prepared GPU check into $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/p && cp "$here"/part.* /tmp/p/
cat $(ls /tmp/p/part.* | sort -t. -k2 -n) > /tmp/site.tar.xz
echo "{sha}  /tmp/site.tar.xz" | sha256sum -c || exit 3
mkdir -p /tmp/site && tar -xJf /tmp/site.tar.xz -C /tmp/site || exit 4
export PYTHONPATH=/tmp/site LD_PRELOAD=$here/libncclstub.so PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
bash benchmarks/gpu_all.sh "$OUT"
"""


def main() -> int:
    WORK.mkdir(parents=True, exist_ok=True)
    wheels = _download()
    site = _site(wheels)
    packed = WORK / "site.tar.xz"
    with packed.open("wb") as f:
        tar = subprocess.Popen(["tar", "-cf", "-", "-C", str(site), "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-T0", "-6"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait():
            raise RuntimeError("tar failed")
    data = packed.read_bytes()
    parts = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]
    for old in ROOT.glob(".gpu[0-9]*"):
        shutil.rmtree(old)
    for k, part in enumerate(parts):
        folder = ROOT / f".gpu{k}"
        folder.mkdir()
        (folder / f"part.{k}").write_bytes(part)
    last = ROOT / f".gpu{len(parts) - 1}"
    _nccl_stub(wheels, site, last)
    (last / "run.sh").write_text(_RUN_SH.replace("{sha}", hashlib.sha256(data).hexdigest()))
    print(f"{len(data) / 2**20:.0f} MiB in {len(parts)} parts: .gpu0 ... .gpu{len(parts) - 1}; "
          f"last call: bash .gpu{len(parts) - 1}/run.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
