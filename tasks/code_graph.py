"""What code a stage runs, read from the imports: the modules of imagelake a module reaches, and their digest.

A stage's stored result is reused while its key holds, and the key holds its code: the stage's own module and every
module of imagelake that it imports, and that those import in turn, at any depth (imports inside functions and under
`if` included: what may run counts). Third-party packages are not followed; where their version changes an output,
the stage keys that version itself. Reading the imports rather than a list written beside the stage means that a change
to the network, the training loop or a rule it applies changes the key of every stage that runs it, and a change to a
module no stage reaches (the CLI, the docs' renderer) changes none.

A module's digest is taken over its parsed code (`code_of`), not its bytes: comments, docstrings and formatting are
left out, so the same program gives the same digest, while any change to a statement, a default or a literal changes it.

Pure: the standard library only, so the docs and the tests read the same graph that the stages key on.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
from pathlib import Path

PACKAGE = "imagelake"
PARTS = ("flows", "tasks", "infra")  # imagelake's subpackages: the repository's folders of the same names


def code_folders() -> dict[str, Path]:
    """Where each subpackage of imagelake is read from: the folders the installed package imports."""
    folders = {}
    for part in PARTS:
        spec = importlib.util.find_spec(f"{PACKAGE}.{part}")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"{PACKAGE}.{part} is not installed: run make install")
        folders[f"{PACKAGE}.{part}"] = Path(next(iter(spec.submodule_search_locations)))
    return folders


def folders_under(root: Path) -> dict[str, Path]:
    """The subpackages' folders in a copy of the repository (or an installed `imagelake` folder) at ROOT."""
    return {f"{PACKAGE}.{part}": Path(root) / part for part in PARTS}


def module_file(name: str, folders: dict[str, Path]) -> Path | None:
    """The file of imagelake's module or package NAME under FOLDERS, or None where NAME is no module of imagelake (a
    third-party module, or a name imported from a module rather than a module)."""
    for package, folder in folders.items():
        if name == package:
            return folder / "__init__.py"
        if name.startswith(f"{package}."):
            inner = name[len(package) + 1 :].split(".")
            for candidate in (folder.joinpath(*inner).with_suffix(".py"), folder.joinpath(*inner, "__init__.py")):
                if candidate.is_file():
                    return candidate
    return None


@functools.lru_cache(maxsize=1024)
def _imports(path: str, mtime_ns: int, size: int, module: str) -> tuple[str, ...]:
    """Every name the module at PATH imports (absolute; for `from X import Y`, both X and X.Y), wherever in the file."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            names.append(origin)
            names += [f"{origin}.{alias.name}" for alias in node.names if alias.name != "*"]
    return tuple(names)


def imports_of(name: str, path: Path) -> tuple[str, ...]:
    stat = path.stat()
    return _imports(str(path), stat.st_mtime_ns, stat.st_size, name)


def reached(module: str, folders: dict[str, Path] | None = None) -> dict[str, Path]:
    """The modules of imagelake that importing MODULE may run, MODULE first, with their files: the packages that hold
    each (their __init__.py runs first) and everything they import, at any depth."""
    folders = folders if folders is not None else code_folders()
    found: dict[str, Path] = {}
    pending = [module]
    if module_file(module, folders) is None:  # a stage defined outside imagelake (a test's, a plugin's): its own file
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise ModuleNotFoundError(f"no module {module!r} to key a stage's result on")
        found[module] = Path(spec.origin)
        pending = [name for name in imports_of(module, found[module]) if name.startswith(f"{PACKAGE}.")]
    while pending:
        name = pending.pop(0)
        parts = name.split(".")
        for depth in range(2, len(parts) + 1):  # the packages that hold NAME run before it
            enclosing = ".".join(parts[:depth])
            if enclosing in found:
                continue
            path = module_file(enclosing, folders)
            if path is None:
                break
            found[enclosing] = path
            pending += [n for n in imports_of(enclosing, path) if n.startswith(f"{PACKAGE}.") and n not in found]
    if module not in found:
        raise ModuleNotFoundError(f"no module {module!r} of {PACKAGE} to key a stage's result on")
    return found


def _without_docstrings(tree: ast.AST) -> ast.AST:
    """TREE with the docstring of the module and of each class and function taken out (an empty body keeps a `pass`)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0] if node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            node.body = node.body[1:] or ([] if isinstance(node, ast.Module) else [ast.Pass()])
    return tree


@functools.lru_cache(maxsize=1024)
def _code_of(path: str, mtime_ns: int, size: int) -> str:
    tree = _without_docstrings(ast.parse(Path(path).read_text(encoding="utf-8"), filename=path))
    return hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()[:16]


def code_of(path: Path) -> str:
    """A digest of the program in the file at PATH: its syntax tree without docstrings, so that a comment, a docstring
    or a change of layout leaves it as it was and any change to a statement, a name or a literal does not."""
    stat = path.stat()
    return _code_of(str(path), stat.st_mtime_ns, stat.st_size)


def code_digest(module: str, folders: dict[str, Path] | None = None) -> str:
    """A digest of the code of every module of imagelake that MODULE reaches (`reached`): it changes when any of
    their code does, and with no other file."""
    return hashlib.sha256(json.dumps(code_parts(module, folders), sort_keys=True).encode()).hexdigest()


def code_parts(module: str, folders: dict[str, Path] | None = None) -> dict[str, str]:
    """Each file MODULE reaches, by its path in the repository, with a digest of its code (`code_of`): a key made of
    these says which file changed."""
    folders = folders if folders is not None else code_folders()
    return {
        shown: code_of(path)
        for shown, path in zip(repo_files(module, folders), files_reached(module, folders), strict=True)
    }


def files_reached(module: str, folders: dict[str, Path]) -> list[Path]:
    """The files MODULE reaches, MODULE's own first, the others in the order of their paths in the repository."""
    paths = reached(module, folders)
    own = paths.pop(module)
    return [own, *sorted(paths.values(), key=lambda path: repo_path(path, folders))]


def repo_path(path: Path, folders: dict[str, Path]) -> str:
    """A file of imagelake as its path in the repository (tasks/stages/train.py); another file as its own path."""
    inside = (str(path.relative_to(folder.parent)) for folder in folders.values() if path.is_relative_to(folder))
    return next(inside, str(path))


def repo_files(module: str, folders: dict[str, Path] | None = None) -> list[str]:
    """The files MODULE reaches, as paths in the repository (tasks/stages/train.py), MODULE's own first."""
    folders = folders if folders is not None else code_folders()
    return [repo_path(path, folders) for path in files_reached(module, folders)]
