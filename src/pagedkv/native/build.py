"""Building a C kernel's shared library on first use, once per source, compiler and CPU.

A library is compiled with ``-O3 -march=native`` (for the CPU it runs on, which its cache name
includes) and ``-fopenmp``: it then asks for ``libgomp.so.1``, which resolves to the runtime
torch has already loaded under that name, so a kernel's threads are torch's own pool. Built
libraries are kept in ``$PAGEDKV_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/pagedkv/kernels``, else
``~/.cache/pagedkv/kernels``. Where no compiler is found or the build fails, the caller gets a
:class:`BuildFailure` with the reason, and falls back to its torch formulation.

Code that several kernels share lives in headers beside this module (:data:`HEADERS`), which a
source includes by name (``#include "fast_exp.h"``); a library's name changes with the bytes
of every header its source includes that way, as with its own.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Every kernel's compiler flags: optimised for this CPU, OpenMP, a shared library.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")

#: The folder of the headers kernels share, on every build's include path.
HEADERS = Path(__file__).parent

_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True, slots=True)
class BuildFailure:
    """Why a kernel could not be built (no compiler, or the compiler's own message)."""

    reason: str


def cache_dir() -> Path:
    """Where built kernels are kept (see the module docstring)."""
    explicit = os.environ.get("PAGEDKV_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedkv" / "kernels"


def find_compiler() -> str | None:
    """``$CC`` if set, else the first of ``cc``, ``gcc`` and ``clang`` on the ``PATH``."""
    wanted = os.environ.get("CC")
    for name in (wanted,) if wanted else ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so a cache shared by other CPUs rebuilds for each."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _included(source: Path) -> list[bytes]:
    """The bytes of each header ``source`` includes by name, found beside it or in
    :data:`HEADERS` (one not found is left to the compiler to report)."""
    found = []
    for name in _LOCAL_INCLUDE.findall(source.read_bytes()):
        for folder in (source.parent, HEADERS):
            header = folder / name.decode()
            if header.is_file():
                found.append(header.read_bytes())
                break
    return found


def build_library(
    source: Path, folder: Path | None = None, extra_flags: Sequence[str] = ()
) -> Path | BuildFailure:
    """The path of ``source`` built as a shared library, compiling it into ``folder`` (default
    :func:`cache_dir`) with :data:`CFLAGS` and ``extra_flags`` if it is not there yet. The
    build writes a temporary file and renames it, so a concurrent build or an interrupted one
    never leaves a partial library under the final name."""
    compiler = find_compiler()
    if compiler is None:
        return BuildFailure("no C compiler found ($CC, cc, gcc or clang)")
    flags = (*CFLAGS, *extra_flags)
    identity = [
        source.read_bytes(),
        *_included(source),
        *(s.encode() for s in (compiler, " ".join(flags), _cpu_flags())),
    ]
    key = hashlib.sha256(b"\0".join(identity)).hexdigest()[:16]
    folder = folder or cache_dir()
    library = folder / f"{source.stem}-{key}.so"
    if library.exists():
        return library
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            partial = Path(scratch) / library.name
            done = subprocess.run(
                [compiler, *flags, f"-I{HEADERS}", "-o", str(partial), str(source)],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                return BuildFailure(f"{compiler} failed: {done.stderr.strip()[-500:]}")
            os.replace(partial, library)
    except OSError as exc:
        return BuildFailure(f"cannot build into {folder}: {exc}")
    return library


def entry_address(entry: Any) -> int:
    """The address of a loaded library's entry point (a ``ctypes`` function of a
    :func:`load_library` library), for C code that calls it by pointer
    (as ``decode_layers.c`` calls the other kernels)."""
    address = ctypes.cast(entry, ctypes.c_void_p).value
    if address is None:
        raise ValueError("a loaded entry point has an address")
    return address


def load_library(
    source: Path, folder: Path | None = None, extra_flags: Sequence[str] = ()
) -> ctypes.CDLL | BuildFailure:
    """``source``'s library (see :func:`build_library`), loaded; the reason it cannot be."""
    library = build_library(source, folder, extra_flags)
    if isinstance(library, BuildFailure):
        return library
    try:
        return ctypes.CDLL(str(library))
    except OSError as exc:
        return BuildFailure(f"cannot load {library.name}: {exc}")
