"""The reference tables of the docs, rendered from the code: every setting, and what each stage's key holds.

A hand-kept table of settings or of stage keys falls behind the code as soon as a field or a stage's declaration
changes, and a reader then trusts a default or a key that no longer holds. So both tables are rendered from the code
itself (the fields and descriptions of `Settings`, the `@stage(settings=..., code=..., facts=...)` declarations) into
marked regions of docs/settings.md and docs/caching.md, and tests/test_docs.py fails when a region differs from what
the code renders now. After changing a setting or a stage, rewrite the regions:

    python -m imagelake.flows.docs_reference --write

It lives in flows/, the top layer, because it reads both tasks/ (the stages) and infra/ (the settings).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Callable
from datetime import date
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from imagelake.infra.declare import SECTIONS, declaration, sections
from imagelake.infra.run_policy import ALLOWED_FROM_RUNS, RUN_LIMITS
from imagelake.infra.settings import Settings
from imagelake.tasks.code_graph import repo_files

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
END = "<!-- end generated -->"

# The stages in the order a run meets them; a stage not named here follows, by name.
STAGE_ORDER = ("ingest", "resize", "write", "split", "cache", "train", "promote", "score")


def start_marker(name: str) -> str:
    return f"<!-- generated: {name} -->"


# --- Settings ---------------------------------------------------------------------------------------------------------


def type_text(annotation: Any) -> str:
    """A field's type in words a settings file's author reads: `integer`, `number or unset`, `letterbox or
    center_crop`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, UnionType):
        kinds = [type_text(arg) for arg in args if arg is not NoneType]
        text = " or ".join(kinds)
        return f"{text} or unset" if NoneType in args else text
    if origin is Literal:
        if len(args) > 8:  # model_arch: the description names the common ones
            return f"one of {len(args)} names"
        return " or ".join(f"`{arg}`" for arg in args)
    if origin is list:
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {type_text(args[0])} to {type_text(args[1])}" if args else "map"
    return {
        int: "integer",
        float: "number",
        bool: "true or false",
        str: "text",
        Path: "path",
        date: "date (YYYY-MM-DD)",
    }.get(annotation, getattr(annotation, "__name__", str(annotation)))


def limits_text(field: FieldInfo) -> str:
    """The bounds pydantic enforces on a field (`>= 8, <= 2048`), from its metadata."""
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    bounds = []
    for item in field.metadata:
        for attribute, sign in words.items():
            value = getattr(item, attribute, None)
            if value is not None:
                bounds.append(f"{sign} {value:g}" if isinstance(value, float) else f"{sign} {value}")
    return ", ".join(bounds)


def value_text(name: str, value: Any) -> str:
    """A default as it would be written in a settings file."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, int) and name.endswith("_bytes") and value % (1024 * 1024) == 0:
        return f"`{value}` ({value // (1024 * 1024)} MiB)"
    if isinstance(value, (list, tuple)):
        return ", ".join(f"`{item}`" for item in value) if value else "`[]`"
    if isinstance(value, dict):
        return ", ".join(f"`{key}: {item}`" for key, item in value.items()) if value else "`{}`"
    return f"`{value}`"


def default_text(name: str, field: FieldInfo) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    return value_text(name, value)


def from_runs_text(name: str) -> str:
    """What a run started from a deployment may do with the setting: its declaration's runs= and cap=
    (infra/settings.py: ALLOWED_FROM_RUNS, RUN_LIMITS, derived from them)."""
    if name not in ALLOWED_FROM_RUNS:
        return "no: the worker's"
    if name in RUN_LIMITS:
        side, limit = RUN_LIMITS[name]
        return f"{side} {value_text(name, limit)}"
    if name == "pretrained":  # infra/run_policy.py:refusal: a file or URL would be fetched and loaded
        return "a weights name, not a path or URL"
    return "yes"


def prose(text: str) -> str:
    """A paragraph wrapped as the hand-written ones around it are."""
    return textwrap.fill(text, width=118, break_long_words=False, break_on_hyphens=False)


def cell(text: str) -> str:
    """Text that stays inside one cell of a markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


def settings_table() -> str:
    """Every field of Settings by section (its declaration's section=): its type and bounds, its default, whether a
    deployment run may set it, its description; under each table, why runs may not set the refused ones or go past
    a cap (why=)."""
    described = {name for name, field in Settings.model_fields.items() if field.description}
    out = []
    for section, names in sections(Settings).items():
        out += [f"### {section[0].upper()}{section[1:]}", "", prose(SECTIONS[section]), ""]
        out += ["| setting | type | default | a deployment run may set it | what it does |", "|---|---|---|---|---|"]
        for name in names:
            field = Settings.model_fields[name]
            kind = ", ".join(part for part in (type_text(field.annotation), limits_text(field)) if part)
            description = field.description or ""
            out.append(
                f"| `{name}` | {cell(kind)} | {cell(default_text(name, field))} | {from_runs_text(name)} | "
                f"{cell(description)} |"
            )
        out.append("")
        reasons: dict[str, list[str]] = {}
        for name in names:
            found = declaration(Settings, name)
            if found is not None and found.why:
                reasons.setdefault(found.why, []).append(name)
        for why, named in reasons.items():
            out.append(f"- {', '.join(f'`{name}`' for name in named)}: {why[0].upper()}{why[1:]}.")
        if reasons:
            out.append("")
    missing = sorted(set(Settings.model_fields) - described)
    if missing:
        out.append(prose(f"No description in the code yet: {', '.join(f'`{name}`' for name in missing)}."))
        out.append("")
    return "\n".join(out).rstrip("\n")


# --- Stage keys -------------------------------------------------------------------------------------------------------


def stage_modules() -> list[str]:
    """The modules of tasks/stages/ that declare a stage (read as text first, as every module that declares one is)."""
    return sorted(
        f"imagelake.tasks.stages.{path.stem}"
        for path in (REPO / "tasks" / "stages").glob("*.py")
        if "\n@stage(" in path.read_text(encoding="utf-8")
    )


def stages() -> tuple[list[Any], list[Any]]:
    """Every declared stage: those with a key, whose stored result a run may reuse (in the order a run meets them), and
    those that run every time."""
    from prefect import Task

    from imagelake.tasks.stage import StageKey

    found: dict[str, Any] = {}
    for module in stage_modules():
        for value in vars(importlib.import_module(module)).values():
            if isinstance(value, Task) and value.fn.__module__ == module:
                found[value.name] = value
    rank = {name: index for index, name in enumerate(STAGE_ORDER)}
    ordered = sorted(found.values(), key=lambda task: (rank.get(task.name, len(rank)), task.name))
    cached = [task for task in ordered if isinstance(task.cache_policy, StageKey)]
    return cached, [task for task in ordered if not isinstance(task.cache_policy, StageKey)]


def reads(name: str, seen: frozenset[str] = frozenset()) -> list[str]:
    """The fields a derived location (a property of Settings, e.g. table_uri) is made of, read from its source."""
    attribute = getattr(Settings, name, None)
    if not isinstance(attribute, property) or name in seen:
        return [name] if name in Settings.model_fields else []
    fields: list[str] = []
    for used in re.findall(r"self\.(\w+)", inspect.getsource(attribute.fget)):
        fields += [field for field in reads(used, seen | {name}) if field not in fields]
    return fields


def facts_text(facts: Callable[..., Any] | None) -> str:
    """What a stage reads when its key is computed: the first sentence of its facts function's docstring."""
    if facts is None or not facts.__doc__:
        return ""
    text = " ".join(facts.__doc__.split())
    text = re.sub(r"^Key part for [\w-]+[^:]*: ", "", text)
    first = re.split(r"(?<=[.)])\s", text, maxsplit=1)[0].rstrip(".")
    return first[0].upper() + first[1:] if first else ""


def stage_key_table() -> str:
    """Each keyed stage's key: the settings it declares, what it reads when the key is computed, and the code it covers
    (every file of imagelake its module reaches through imports: tasks/code_graph.py)."""
    cached, uncached = stages()
    out = ["| stage | settings in its key | read when the key is computed | code in its key |", "|---|---|---|---|"]
    derived: list[str] = []
    files = {task.name: repo_files(task.fn.__module__) for task in cached}
    shared = set.intersection(*(set(reached[1:]) for reached in files.values())) if files else set()
    for task in cached:
        policy = task.cache_policy
        names = []
        for name in policy.settings_fields:
            names.append(f"`{name}`")
            if name not in Settings.model_fields and name not in derived:
                derived.append(name)
        own, *others = files[task.name]
        code = f"`{own}` and the {len(others)} files it reaches"
        read = facts_text(policy.facts) or "nothing besides its input"
        out.append(f"| {task.name} | {', '.join(names)} | {cell(read)} | {code} |")
    out.append("")
    if derived:
        out.append("Locations in the keys are derived from settings (as a digest where the name ends in `uri`):")
        out.append("")
        out += [f"- `{name}`: {', '.join(f'`{field}`' for field in reads(name))}" for name in derived]
        out.append("")
    out.append(
        prose(f"Every stage's key holds these {len(shared)} files: {', '.join(f'`{f}`' for f in sorted(shared))}.")
    )
    out.append("")
    out.append("Beside those, each stage's own module and the files only some stages reach:")
    out.append("")
    for task in cached:
        own, *others = files[task.name]
        more = [f"`{path}`" for path in others if path not in shared]
        out.append(f"- {task.name}: `{own}`" + (f"; {', '.join(more)}" if more else ""))
    out.append("")
    if uncached:
        out.append(prose(f"No stored result to reuse (they run every time): {', '.join(t.name for t in uncached)}."))
    return "\n".join(out).rstrip("\n")


# --- The marked regions -----------------------------------------------------------------------------------------------

REGIONS: dict[str, tuple[Path, Callable[[], str]]] = {
    "settings": (DOCS / "settings.md", settings_table),
    "stage-keys": (DOCS / "caching.md", stage_key_table),
}


def replaced(text: str, name: str, body: str) -> str:
    """TEXT with the region NAME (between its start marker and the next end marker) holding BODY."""
    start = start_marker(name)
    if text.count(start) != 1:
        raise ValueError(f"expected one {start} marker, found {text.count(start)}")
    head, tail = text.split(start, 1)
    if END not in tail:
        raise ValueError(f"{start} has no {END} after it")
    return f"{head}{start}\n{body}\n{END}{tail.split(END, 1)[1]}"


def rendered() -> dict[Path, str]:
    """Each page with a generated region, as the code would write it now."""
    pages: dict[Path, str] = {}
    for name, (path, render) in REGIONS.items():
        pages[path] = replaced(pages.get(path, path.read_text(encoding="utf-8")), name, render())
    return pages


def stale() -> list[Path]:
    """The pages whose generated regions differ from what the code renders now."""
    return [path for path, text in rendered().items() if path.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m imagelake.flows.docs_reference", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--write", action="store_true", help="rewrite the generated regions of the docs")
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated region differs from the code")
    args = parser.parse_args(argv)
    if args.write:
        for path, text in rendered().items():
            if path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")
                print(f"rewrote {path.relative_to(REPO)}")
        return 0
    if args.check:
        pages = stale()
        for path in pages:
            print(
                f"{path.relative_to(REPO)} differs from the code: run python -m imagelake.flows.docs_reference --write"
            )
        return 1 if pages else 0
    for name, (path, render) in REGIONS.items():
        print(f"{start_marker(name)} ({path.relative_to(REPO)})\n{render()}\n{END}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
