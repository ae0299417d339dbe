"""The package layout keeps its rooms apart, checked on the source (every import statement, at
the top of a module or inside a function): the KVManager's package is torch-free (KVM-040), and
what people use holds engines only through the Engine Protocol (ENG-063)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import pagedkv

SRC = Path(pagedkv.__file__).parent


def imported_modules(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, a module under the import root
    ``root``; relative imports resolved."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield node.lineno, base
            for alias in node.names:  # ``from pagedkv import store`` imports a module too
                yield node.lineno, f"{base}.{alias.name}"


def offences(paths: list[Path], forbidden: tuple[str, ...], root: Path = SRC.parent) -> list[str]:
    """Each import of a ``forbidden`` module (or one inside it) in ``paths``, sorted."""
    found = []
    for path in paths:
        for line, module in imported_modules(path, root):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(root).as_posix()}:{line} imports {module}")
    return sorted(found)


def test_imported_modules_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    source = tmp_path / "pagedkv" / "kv" / "probe.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    import torch\n\nfrom ..store import paged_store\n")
    assert offences([source], ("torch", "pagedkv.store"), root=tmp_path) == [
        "pagedkv/kv/probe.py:2 imports torch",
        "pagedkv/kv/probe.py:4 imports pagedkv.store",
        "pagedkv/kv/probe.py:4 imports pagedkv.store.paged_store",
    ]


@pytest.mark.spec("KVM-040")
def test_the_kv_package_imports_no_torch() -> None:
    paths = sorted((SRC / "kv").glob("*.py"))
    assert len(paths) >= 5
    forbidden = ("torch", "pagedkv.store", "pagedkv.model", "pagedkv.engine", "pagedkv.backend")
    assert offences(paths, forbidden) == []


def test_the_kernel_build_package_imports_no_torch() -> None:
    """``pagedkv.native`` compiles C sources; the kernels' torch wrappers live with their users
    (the store's decode attention, the model's fused norms)."""
    paths = sorted((SRC / "native").glob("*.py"))
    assert len(paths) >= 2
    forbidden = ("torch", "pagedkv.store", "pagedkv.model", "pagedkv.engine")
    assert offences(paths, forbidden) == []


@pytest.mark.spec("ENG-063")
def test_what_people_use_holds_engines_through_the_protocol() -> None:
    paths = sorted((SRC / "entrypoints").rglob("*.py")) + [SRC / "engine" / "llm.py"]
    assert len(paths) >= 20
    forbidden = (
        "pagedkv.engine.engine",
        "pagedkv.engine.runner",
        "pagedkv.kv",
        "pagedkv.store",
        "pagedkv.model",
    )
    assert offences(paths, forbidden) == []
