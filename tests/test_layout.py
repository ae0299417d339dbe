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


#: What an acceleration's kernels are reached by: none of it belongs in the reference model.
ACCELERATION_IMPORTS = ("ctypes", "pagedkv.accel", "pagedkv.native")

#: Names of a kernel's slot on a module: a reference class that declares one is mutated by an
#: acceleration instead of substituted.
KERNEL_SLOTS = ("fused", "gemv", "packed", "kernel")


def kernel_slots(paths: list[Path]) -> list[str]:
    """``file: Class.name`` of each class attribute in ``paths`` named like a kernel's slot."""
    slots = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            for statement in node.body:
                targets = (
                    [statement.target]
                    if isinstance(statement, ast.AnnAssign)
                    else statement.targets
                    if isinstance(statement, ast.Assign)
                    else []
                )
                for target in targets:
                    if isinstance(target, ast.Name) and target.id.startswith(KERNEL_SLOTS):
                        slots.append(f"{path.name}: {node.name}.{target.id}")
    return slots


@pytest.mark.spec("ENG-161")
def test_the_reference_model_is_plain_torch() -> None:
    """``pagedkv.model`` imports no kernel, calls no oneDNN op, and none of its classes
    declares a kernel's slot."""
    paths = sorted((SRC / "model").glob("*.py"))
    assert len(paths) >= 10
    assert offences(paths, ACCELERATION_IMPORTS) == []
    assert [p.name for p in paths if "mkldnn" in p.read_text(encoding="utf-8")] == []
    assert kernel_slots(paths) == []


def test_the_plain_torch_checks_see_a_kernel(tmp_path: Path) -> None:
    """The checks above fail on a module that imports ctypes and a class that declares a
    kernel's slot (the way the reference norms once held theirs)."""
    source = tmp_path / "pagedkv" / "model" / "probe.py"
    source.parent.mkdir(parents=True)
    source.write_text("import ctypes\n\nclass RMSNorm:\n    fused: object = None\n    gemv = 1\n")
    assert offences([source], ACCELERATION_IMPORTS, root=tmp_path) == [
        "pagedkv/model/probe.py:1 imports ctypes"
    ]
    assert kernel_slots([source]) == ["probe.py: RMSNorm.fused", "probe.py: RMSNorm.gemv"]
