"""The rooms keep to their walls, checked on the source (ENG-052, ENG-027):

* the server, the command line and the benchmarks use engines only through the ``Engine``
  Protocol: none imports the engine implementation or its scheduler, or reaches for an
  engine's ``scheduler``;
* in the engine, the plan, the runner and the model, only the paged scheduler calls the
  KVManager.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedkv"
#: Modules that implement the engine; its users may not import them.
ENGINE_INTERNALS = (
    "pagedkv.engine.engine",
    "pagedkv.engine.scheduler",
    "pagedkv.engine.paged_scheduler",
    "pagedkv.engine.recompute_scheduler",
)
#: The KVManager's lookups and state changes.
KV_CALLS = frozenset({"match_prefix", "cached_prefix_length", "allocate", "grow", "commit", "free"})


def modules(*patterns: str) -> Iterator[Path]:
    for pattern in patterns:
        yield from sorted(SRC.glob(pattern))


def engine_users() -> Iterator[Path]:
    return modules("server/*.py", "cli*.py", "bench/*.py")


def imported(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.spec("ENG-052")
@pytest.mark.parametrize("path", list(engine_users()), ids=lambda p: str(p.relative_to(SRC)))
def test_engine_users_live_on_the_protocol(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = imported(tree)
    internal = sorted(n for n in names if n.startswith(ENGINE_INTERNALS) or n.endswith("LLMEngine"))
    assert not internal, f"{path.name} imports engine internals: {internal}"
    reached = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in {"scheduler", "_requests"}
    ]
    assert not reached, f"{path.name} reaches into an engine at lines {reached}"


@pytest.mark.spec("ENG-027")
def test_only_the_paged_scheduler_calls_the_kv_manager() -> None:
    callers: dict[str, list[int]] = {}
    for path in modules("engine/*.py", "plan.py", "model/*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        lines = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in KV_CALLS
            and isinstance(node.func.value, ast.Attribute | ast.Name)
            and (ast.unparse(node.func.value).endswith("kv"))
        ]
        if lines:
            callers[path.name] = lines
    assert set(callers) == {"paged_scheduler.py"}, callers
