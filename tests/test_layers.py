"""The layers only look down: flows/ -> tasks/ -> infra/, and the pure rules import no engine."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

LAYERS = {"flows": 3, "tasks": 2, "infra": 1}
ENGINES = ("pyspark", "ray", "mlflow", "prefect", "deltalake", "delta", "torch", "petastorm", "pytorch_lightning")


def imported_packages(path: Path) -> set[str]:
    """The top-level names every import in a file (function bodies included) reaches."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_import_runs_up_a_layer() -> None:
    upward = []
    for layer, floor in LAYERS.items():
        for path in sorted((REPO / layer).rglob("*.py")):
            above = {name for name in imported_packages(path) if LAYERS.get(name, 0) > floor}
            upward += [f"{path.relative_to(REPO)} imports {name}" for name in sorted(above)]
    assert not upward, upward


def test_the_rules_and_the_results_import_no_engine() -> None:
    modules = sorted(
        f"tasks.rules.{path.stem}" for path in (REPO / "tasks" / "rules").glob("*.py") if path.stem != "__init__"
    )
    modules.append("tasks.results")
    code = (
        f"import importlib, json, sys; [importlib.import_module(m) for m in {modules!r}]; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = set(
        json.loads(
            subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
        )
    )
    assert len(modules) >= 9
    assert not {name.split(".")[0] for name in loaded} & set(ENGINES), sorted(
        name for name in loaded if name.split(".")[0] in ENGINES
    )
