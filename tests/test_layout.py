"""The package layout keeps its rooms apart, checked on the source (every import statement, at
the top of a module or inside a function): the KVManager's package is torch-free (KVM-040),
what people use holds engines only through the Engine Protocol (ENG-063), and no module imports
itself back through others: the modules stand in layers, with the Protocols low (ENG-064)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
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


def module_names(package: Path, root: Path) -> dict[str, Path]:
    """Every module of the package directory ``package`` (under the import root ``root``) by
    its dotted name; a package is named by its ``__init__.py``."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(package: Path, root: Path) -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of ``package`` it imports anywhere in its
    source. An imported name is mapped to the longest module its dotted name starts with
    (``pagedkv.plan.StepPlan`` is ``pagedkv.plan``); names outside the package are dropped."""
    modules = module_names(package, root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, imported in imported_modules(path, root):
            target = imported
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def import_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module, each sorted,
    in sorted order (Tarjan's algorithm, iterative): the modules that import one another."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return sorted(cycles)


def test_import_cycles_are_found_through_every_kind_of_import(tmp_path: Path) -> None:
    """A planted cycle through a function-level import and a relative one is found; a chain
    without a way back, an import of a name inside a module and one outside the package are
    not cycles."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import thing\n",
        "pkg/b.py": "def f():\n    from .sub import c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import os\nfrom ..a import name\n",
        "pkg/d.py": "from pkg import a\nfrom pkg.sub.c import name\n",
        "pkg/e.py": "import pkg.e\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path / "pkg", tmp_path)
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.c"}
    assert graph["pkg.d"] == {"pkg", "pkg.a", "pkg.sub.c"}
    assert graph["pkg.e"] == set()
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    return 1\n")
    assert import_cycles(import_graph(tmp_path / "pkg", tmp_path)) == []


def test_import_cycles_lists_every_cycle_apart() -> None:
    graph = {"a": ["b"], "b": ["a", "c"], "c": ["d"], "d": ["c", "e"], "e": [], "f": ["f"]}
    assert import_cycles(graph) == [["a", "b"], ["c", "d"]]


@pytest.mark.spec("ENG-064")
def test_src_has_no_import_cycles() -> None:
    graph = import_graph(SRC, SRC.parent)
    assert len(graph) >= 100
    assert [" <-> ".join(cycle) for cycle in import_cycles(graph)] == []


@pytest.mark.spec("ENG-064")
def test_the_protocols_import_nothing_above_them() -> None:
    """``pagedkv.interfaces`` reaches, through every import it makes and those they make, only
    the errors, the step's data and the engine's value types: no implementation of a Protocol,
    nothing that imports the Protocols back."""
    graph = import_graph(SRC, SRC.parent)
    reached: set[str] = set()
    todo = ["pagedkv.interfaces"]
    while todo:
        for imported in graph[todo.pop()] - reached:
            reached.add(imported)
            todo.append(imported)
    below = {
        "pagedkv.device",
        "pagedkv.errors",
        "pagedkv.plan",
        "pagedkv.engine.chat_template",
        "pagedkv.engine.config",
        "pagedkv.engine.detokenizer",
        "pagedkv.engine.generation_config",
        "pagedkv.engine.outputs",
        "pagedkv.engine.params",
        "pagedkv.engine.prompts",
        "pagedkv.engine.structured",
        "pagedkv.engine.text_bound",
        "pagedkv.engine.tokenizer",
    }
    assert sorted(reached - below) == []


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


def literal_device_defaults(paths: list[Path]) -> list[str]:
    """``file:line name`` of each parameter in ``paths`` whose default is a device's name."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.arguments):
                continue
            positional = [*node.posonlyargs, *node.args]
            pairs = [
                *zip(
                    positional[len(positional) - len(node.defaults) :], node.defaults, strict=True
                ),
                *zip(node.kwonlyargs, node.kw_defaults, strict=True),
            ]
            for arg, default in pairs:
                if isinstance(default, ast.Constant) and default.value in ("cpu", "cuda"):
                    found.append(f"{path.name}:{default.lineno} {arg.arg}")
    return sorted(found)


@pytest.mark.spec("ENG-065")
def test_one_module_names_the_default_device() -> None:
    """Every entry point defaults to ``pagedkv.device.DEFAULT_DEVICE``: no parameter of
    ``src/`` defaults to a device's name of its own."""
    assert literal_device_defaults(sorted(SRC.rglob("*.py"))) == []


def test_a_literal_device_default_is_found(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text('def f(a, device="cpu", *, kind: str = "cuda", n=1): ...\n')
    assert literal_device_defaults([source]) == ["probe.py:1 device", "probe.py:1 kind"]


#: The modules of the CUDA room that import triton (or a module that does) at their top.
TRITON_MODULES = (
    "store_kernel",
    "decode_kernel",
    "prefill_kernel",
    "triton_store",
    "norm_kernel",
    "swiglu_kernel",
    "fused_modules",
)


def top_level_imports(path: Path, root: Path) -> set[str]:
    """The modules ``path`` imports outside any function (its import-time dependencies)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inside.update(id(child) for child in ast.walk(node))
    lines = {
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in inside
    }
    return {module for line, module in imported_modules(path, root) if line in lines}


@pytest.mark.spec("PST-046")
def test_only_the_cuda_room_imports_triton_and_the_rest_only_when_asked() -> None:
    """Nothing outside ``pagedkv.accel.cuda`` imports triton or the room's kernels, but the
    backend and the runner through the modules that resolve the options (``attention`` and
    ``fused_ops``), which import them inside their functions only; the reference model, the
    store and the torch-free packages import nothing of the room."""
    room = SRC / "accel" / "cuda"
    kernels = tuple(f"pagedkv.accel.cuda.{name}" for name in TRITON_MODULES)
    outside = [p for p in sorted(SRC.rglob("*.py")) if room not in p.parents]
    assert len(outside) >= 100
    assert offences(outside, ("triton", *kernels)) == []
    for choice in ("attention_choice.py", "fused_choice.py", "triton_substitute.py"):
        assert top_level_imports(room / choice, SRC.parent) & {"triton", *kernels} == set()
    plain = [
        p
        for package in ("model", "store", "kv", "native")
        for p in sorted((SRC / package).rglob("*.py"))
    ]
    assert offences(plain, ("triton", "pagedkv.accel.cuda")) == []
    importers = {
        path.stem
        for path in sorted(room.glob("*.py"))
        if any(
            m == "triton" or m.startswith("triton.") for _, m in imported_modules(path, SRC.parent)
        )
    }
    assert importers == {
        "store_kernel",
        "decode_kernel",
        "prefill_kernel",
        "norm_kernel",
        "swiglu_kernel",
    }


def test_top_level_imports_leave_out_function_imports(tmp_path: Path) -> None:
    source = tmp_path / "pkg" / "mod.py"
    source.parent.mkdir()
    source.write_text("import os\n\ndef f():\n    import triton\n")
    assert top_level_imports(source, tmp_path) == {"os"}
