"""Build and load the native CPU kernels (``csrc/*.cpp``) as torch operators.

The sources are compiled once per machine with the system's C++ compiler against torch's
headers and libraries (about 10 s), with ``-march=native`` so that the vector paths this CPU
has (AVX-512 VNNI, AVX2) are the ones built, into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) under a name that hashes
the sources, the flags, the CPU's instruction sets and torch's version: an edited source or
another CPU builds again, a later start loads the cached library in well under a second.
The operators are ``torch.ops.tokenmill_cpu.*``; they run on torch's intra-op threads (the
library links the OpenMP runtime torch has loaded).

Where the build is impossible (no compiler, a read-only cache), ``native_ops()`` returns None
once, with a warning, and the layers keep their torch paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]


def _cpu_flags() -> str:
    """The instruction-set flags of this CPU (``/proc/cpuinfo``), or the machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.machine()


def _build_name(sources: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(_cpu_flags().encode())
    digest.update(torch.__version__.encode())
    return f"tokenmill_cpu_{digest.hexdigest()[:12]}"


def _compile(sources: list[Path], target: Path) -> None:
    """Compile ``sources`` into the shared library ``target`` (written whole, then renamed,
    so processes building at once never load a partial file).

    Raises:
        RuntimeError: no C++ compiler, or the compiler's first error line.
    """
    from torch.utils import cpp_extension

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *(f"-I{p}" for p in cpp_extension.include_paths()),
           *map(str, sources), "-o", tmp,
           f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
        raise RuntimeError((errors or done.stderr.splitlines() or ["compiler failed"])[0])
    os.replace(tmp, target)


@functools.cache
def native_ops():
    """``torch.ops.tokenmill_cpu`` after building or loading the kernels, or None where they
    cannot be built (a warning says why; callers fall back to torch)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch.utils import cpp_extension

    sources = sorted(CSRC.glob("*.cpp"))
    name = _build_name(sources)
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        target = build_dir / f"{name}.so"
        if not target.exists():
            _compile(sources, target)
        torch.ops.load_library(str(target))
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("native CPU kernels unavailable (%s); using torch's kernels",
                       str(e).strip()[:300])
        return None
    return torch.ops.tokenmill_cpu
