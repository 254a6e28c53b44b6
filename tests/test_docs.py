"""The docs' reference tables hold what the code holds: every setting, and what each stage's key is made of.

Both tables are rendered from the code (flows/docs_reference.py) into marked regions of docs/settings.md and
docs/caching.md. A setting added, renamed or described anew, or a stage that declares other settings, changes what
the code renders; these tests fail until `python -m imagelake.flows.docs_reference --write` has rewritten the
pages. Nothing is
started: the stages' modules are imported, never run.
"""

from __future__ import annotations

import pytest

from imagelake.flows import docs_reference
from imagelake.infra.settings import Settings


def test_the_generated_regions_of_the_docs_hold_what_the_code_renders_now() -> None:
    stale = [str(path.relative_to(docs_reference.REPO)) for path in docs_reference.stale()]
    assert not stale, (
        f"out of date with the code: {', '.join(stale)}; run python -m imagelake.flows.docs_reference --write"
    )


def test_every_setting_has_a_row_with_its_default() -> None:
    table = docs_reference.settings_table()
    for name in Settings.model_fields:
        assert f"| `{name}` |" in table, name
    assert "| `image_size` | integer, >= 8, <= 2048 | `160` | yes |" in table


def test_every_keyed_stage_has_a_row_with_the_settings_it_declares() -> None:
    cached, _ = docs_reference.stages()
    assert [task.name for task in cached][:7] == ["ingest", "resize", "write", "split", "cache", "train", "promote"]
    table = docs_reference.stage_key_table()
    for task in cached:
        row = next(line for line in table.splitlines() if line.startswith(f"| {task.name} |"))
        assert all(f"`{name}`" in row for name in task.cache_policy.settings_fields), task.name


def test_a_region_is_replaced_whole_and_a_missing_marker_is_an_error() -> None:
    text = "before\n<!-- generated: x -->\nold\n<!-- end generated -->\nafter\n"
    assert (
        docs_reference.replaced(text, "x", "new")
        == "before\n<!-- generated: x -->\nnew\n<!-- end generated -->\nafter\n"
    )
    with pytest.raises(ValueError, match="expected one"):
        docs_reference.replaced("no markers", "x", "new")


def test_the_bench_figures_table_is_the_records_latest_and_goes_stale_with_a_new_record(tmp_path, monkeypatch) -> None:
    """bench/README.md's table of figures is rendered from bench/results/*.jsonl (what `make lint` checks); a record
    appended after it was rendered makes it stale, with the new figure as the latest."""
    import shutil
    import sys
    from pathlib import Path

    bench = Path(docs_reference.REPO) / "bench"
    monkeypatch.syspath_prepend(str(bench))
    sys.modules.pop("figures", None)
    import figures

    readme = figures.README.read_text(encoding="utf-8")
    assert figures.rendered(readme, figures.records()) == readme, "run .venv/bin/python bench/figures.py --write"
    assert figures.main(["--check"]) == 0

    copy = tmp_path / "results"
    shutil.copytree(figures.RESULTS, copy, ignore=shutil.ignore_patterns("plots"))
    monkeypatch.setattr(figures, "RESULTS", copy)
    figures.record("startup", "a check", "none", {"help_s": 123.5}, commit="abcdef0", machine={"cores": 2})
    found = figures.records(copy)
    assert found["startup"][-1]["figures"] == {"help_s": 123.5}
    fresh = figures.rendered(readme, found)
    assert fresh != readme and "| `help_s` | 123.5 |" in fresh
    assert "help_s" in figures.history(found["startup"]) and figures.plot("startup", found["startup"], tmp_path)
    assert (tmp_path / "startup.png").stat().st_size > 1000
