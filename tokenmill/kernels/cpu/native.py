"""Build and load the native CPU kernels (``csrc/*.cpp``) as torch operators.

The sources are compiled once per machine by torch's extension builder (g++ and ninja, about
10 s), with ``-march=native`` so that the vector paths this CPU has (AVX-512 VNNI, AVX2) are
the ones built, into ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) under
a name that hashes the sources, the flags and the CPU's instruction sets: an edited source or
another CPU builds again, a later start loads the cached library in well under a second.
The operators are ``torch.ops.tokenmill_cpu.*``; they run on torch's intra-op threads.

Where the build is impossible (no compiler, no ninja, a read-only cache), ``native_ops()``
returns None once, with a warning, and the layers keep their torch paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
LDFLAGS = ["-fopenmp"]


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
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(_cpu_flags().encode())
    digest.update(torch.__version__.encode())
    return f"tokenmill_cpu_{digest.hexdigest()[:12]}"


def _ninja_on_path() -> None:
    """Put the ``ninja`` wheel's binary on PATH when the shell's PATH has none (the builder
    runs ``ninja`` by name)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def native_ops():
    """``torch.ops.tokenmill_cpu`` after building or loading the kernels, or None where they
    cannot be built (a warning says why; callers fall back to torch)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch.utils import cpp_extension

    sources = sorted(CSRC.glob("*.cpp"))
    _ninja_on_path()
    try:
        cpp_extension.load(
            name=_build_name(sources),
            sources=[str(s) for s in sources],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        errors = [line for line in str(e).splitlines() if "error" in line.lower()]
        reason = (errors or [str(e)])[0].strip()[:300]
        logger.warning("native CPU kernels unavailable (%s); using torch's kernels", reason)
        return None
    return torch.ops.tokenmill_cpu
