"""Another checkout's code under the import name `imagelake`, for the benchmarks that run a checkout other than the
installed tree: an earlier commit's beside this one (listing_memory.py and merge_memory.py --against, scale.py --code,
quality.py --ref, each on a `git worktree add /tmp/old COMMIT`), and this repository where imagelake is not installed
(bench/gpu/run.sh, train.py).

The repository has no imagelake/ folder: flows/, tasks/ and infra/ are installed (editable) as imagelake.flows,
imagelake.tasks and imagelake.infra. A checkout's root on the import path therefore provides no `imagelake`, and a
child given one imports the installed tree instead, or fails. import_path(CHECKOUT) returns the entries that fix it,
to put first on the child's path (environ() puts them on PYTHONPATH, which Spark's and Ray's Python workers inherit):

1. a link folder holding imagelake/flows, imagelake/tasks and imagelake/infra, symlinks to the checkout's folders:
   Python's path finder finds the checkout's packages there before setuptools' editable finder, which comes after it
   on sys.meta_path, maps the names to the installed tree;
2. the checkout's root, for a checkout from before the rename (32fa0d0 and earlier), whose code imports its own
   modules as tasks.x, flows.x and infra.x.

The link folder is <temp>/imagelake-imports-<uid>/<checkout's name>-<hash of its path>/ and is left there (three
symlinks, made again when missing or pointing elsewhere; forget() removes it, for a checkout removed after use):
nothing is written into the checkout, and a child that ends with os._exit needs no clean-up.

Run the child in the checkout (cwd): `python -c` and `-m` put the working folder first on the import path, and so do
Ray's workers with their driver's; with this repository's root there, an old checkout's `import tasks.x` would import
this tree's tasks/.

Two more traps, which the other helpers cover:
- a module the checkout lacks is no ImportError: the editable finder maps a child of imagelake.tasks (flows, infra)
  that the path finder did not find to the installed tree, so with a checkout from before tasks/data/,
  `import imagelake.tasks.data.listing` imports this tree's listing. module_in() picks a name by the files the
  checkout holds (the new path, then the old ones: imagelake.tasks.listing, imagelake.tasks.ingest), and verify() and
  verify_module() check that the code a child imported lies in the checkout.
- a checkout from before the rename imports its own modules as tasks.x: a module that the child imports as
  imagelake.tasks.x is a second copy beside those, so a child takes the classes it hands that module from the module
  itself (listing.Scope, write.Resized), not from imports of its own.

    python3 bench/checkout.py DIR    # prints DIR's entries, joined by os.pathsep (for a shell's PYTHONPATH)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

LINKED = ("flows", "tasks", "infra")  # the folders installed as imagelake.flows, imagelake.tasks, imagelake.infra
FIND = "import importlib.util, sys; print(importlib.util.find_spec(sys.argv[1]).origin)"  # where a module would load


def link_folder(checkout: Path | str) -> Path:
    """Where import_path keeps CHECKOUT's links: <temp>/imagelake-imports-<uid>/<its name>-<hash of its path>."""
    root = Path(checkout).resolve()
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"imagelake-imports-{os.getuid()}" / f"{root.name}-{digest}"


def import_path(checkout: Path | str) -> list[str]:
    """The import path entries, in order, under which `import imagelake.tasks.x` imports CHECKOUT's tasks/x.py (and
    tasks.x too, for a checkout from before the rename): the link folder, then the checkout's root."""
    root = Path(checkout).resolve()
    missing = [name for name in LINKED if not (root / name).is_dir()]
    if missing:
        sys.exit(f"{root} is no checkout of imagelake: it has no {', '.join(missing)} folder")
    links = link_folder(root)
    package = links / "imagelake"
    package.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        link, target = package / name, root / name
        if not link.is_symlink() or os.readlink(link) != str(target):
            made = package / f".{name}-{os.getpid()}"
            made.unlink(missing_ok=True)
            made.symlink_to(target, target_is_directory=True)
            os.replace(made, link)  # at once: a child starting meanwhile sees one link or the other
    return [str(links), str(root)]


def forget(checkout: Path | str) -> None:
    """Remove CHECKOUT's link folder (the links only, never what they point to): for a checkout removed after use."""
    shutil.rmtree(link_folder(checkout), ignore_errors=True)


def environ(entries: list[str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """BASE (this process's environment by default) with ENTRIES first on PYTHONPATH, for a child process."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([*entries, *filter(None, [env.get("PYTHONPATH")])])
    return env


def use(checkout: Path | str) -> None:
    """This process, and the processes it starts, import CHECKOUT's code: its entries first on sys.path and on
    PYTHONPATH."""
    entries = import_path(checkout)
    sys.path[:0] = entries
    os.environ["PYTHONPATH"] = environ(entries)["PYTHONPATH"]


def module_in(checkout: Path | str, *names: str) -> str:
    """The first of NAMES (dotted, under imagelake: the module's path now, then the paths it had before) whose file
    CHECKOUT holds. Not an import in a try: a name the checkout lacks would import the installed tree's module."""
    root = Path(checkout).resolve()
    for name in names:
        top, _, rest = name.partition(".")
        if top != "imagelake" or not rest:
            raise ValueError(f"{name}: a module under imagelake")
        path = root.joinpath(*rest.split("."))
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return name
    sys.exit(f"{root} holds none of {', '.join(names)}: is it a checkout of imagelake?")


def verify(checkout: Path | str, file: str) -> None:
    """Exit unless FILE, the __file__ of a module a child imported, lies in CHECKOUT once its links are resolved."""
    root = Path(checkout).resolve()
    if not Path(os.path.realpath(file)).is_relative_to(root):
        sys.exit(f"the child imported {file}, not the code at {root}: is {root} a checkout?")


def verify_module(
    checkout: Path | str, env: Mapping[str, str], module: str = "imagelake.flows.cli", cwd: Path | None = None
) -> None:
    """Exit unless a fresh interpreter with ENV (in CWD) finds MODULE in CHECKOUT: the check for a child that runs the
    checkout's CLI, whose output does not say where its code came from. MODULE's packages are imported, not MODULE."""
    done = subprocess.run(
        [sys.executable, "-c", FIND, module],
        env=dict(env),
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"no {module} with the code at {checkout} on the import path:\n{done.stderr[-2000:]}")
    verify(checkout, done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.rstrip().splitlines()[-1].strip())
    print(os.pathsep.join(import_path(sys.argv[1])))
