"""The `imagelake` command: every flow a user runs (run, backfill, maintain, retrain), the registry commands, the
machine check and the demo data. Flows and stages are imported by the command that needs them, so `--help` is quick."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from imagelake.flows.doctor import PARTS as DOCTOR_PARTS
from imagelake.flows.doctor import run_checks
from imagelake.flows.summary_text import format_search, format_summary
from imagelake.infra.settings import Settings, SettingsError, load_settings
from imagelake.tasks.rules.listed_files import check_date_range

if TYPE_CHECKING:
    from imagelake.infra.prefect_server import TemporaryServer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train image models on a lakehouse.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"imagelake {version('imagelake')}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print imagelake's version and exit."
    ),
) -> None:
    """Train image models on a lakehouse."""


ConfigOption = typer.Option(
    None, "--config", "-c", help="Settings file (.yaml, .toml or .json); IMAGELAKE_* variables override it."
)
SetOption = typer.Option(
    None, "--set", "-s", help="Override one setting: NAME=VALUE (repeatable), e.g. --set max_epochs=3."
)


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """NAME=VALUE pairs into a dict; VALUE is read as JSON when it parses, else kept as text."""
    overrides: dict[str, Any] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise SettingsError(f"--set {pair!r}: write NAME=VALUE, e.g. --set image_size=128")
        try:
            overrides[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name.strip()] = value
    return overrides


def _file(config: Path | None) -> str | None:
    return str(config) if config else None


def _settings_or_exit(config: Path | None, pairs: list[str] | None) -> tuple[Settings, dict[str, Any]]:
    try:
        overrides = parse_overrides(pairs)
        return load_settings(config, overrides), overrides
    except SettingsError as exc:
        typer.secho(f"error: {exc}", err=True, fg="red")
        raise typer.Exit(2) from None


def _prefect_server(settings: Settings) -> TemporaryServer | None:
    """Prefect's temporary server where no API is configured, started before the command imports its flow (the two
    go on at once: infra/prefect_server.py). It stops when the process exits, as Prefect's own does: after Prefect has
    sent the run's last logs and events (atexit runs the handlers registered later first)."""
    import atexit

    from imagelake.infra.prefect_server import start_if_needed

    server = start_if_needed(settings.prefect_api_url)
    if server is not None:
        atexit.register(server.stop)
    return server


def _start(
    settings: Settings,
    flow: Callable[..., Any],
    errors: tuple[type[Exception], ...] = (),
    prefect_server: TemporaryServer | None = None,
    **parameters: Any,
) -> Any:
    """Run FLOW with the settings' Prefect API (else PREFECT_SERVER's) and result store. Bad input or settings
    (ValueError, FileNotFoundError, ERRORS) end the command with exit code 2 and the message, which says what to do; the
    traceback is in the command's log file, which the console names."""
    from imagelake.infra.console import new_log_path, send_library_output_to, tracebacks_to_file
    from imagelake.infra.prefect_env import prefect_for  # imports Prefect, which sets up its console handler

    send_library_output_to(new_log_path(settings.workspace_dir, flow.name))
    tracebacks_to_file()
    try:
        api_url = prefect_server.wait() if prefect_server is not None else None
        with prefect_for(settings, api_url):
            return flow(**parameters)
    except (ValueError, FileNotFoundError, *errors) as exc:
        _fail(exc)


def _print_summary(summary: dict[str, Any], settings: Settings, as_json: bool) -> None:
    from imagelake.infra.console import log_file
    from imagelake.infra.tracking import ui_answers

    summary = {**summary, "log_file": str(log_file() or ""), "mlflow_ui_answers": ui_answers(settings.mlflow_ui_url)}
    typer.echo(format_summary(summary))
    if as_json:
        typer.echo(json.dumps(summary, sort_keys=True))


JsonOption = typer.Option(False, "--json", help="Print the summary as one JSON object on the last line.")
SourceOption = typer.Option(..., "--source", help="Folder (or URI) of images laid out as <label>/<file>.")
RefreshOption = typer.Option(False, "--refresh", help="Recompute every stage even where a stored result fits.")


@app.command()
def run(
    source: str = SourceOption,
    as_json: bool = JsonOption,
    refresh: bool = RefreshOption,
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
) -> None:
    """Run the whole pipeline on SOURCE and print a summary."""
    settings, overrides = _settings_or_exit(config, set_)
    server = _prefect_server(settings)
    from imagelake.flows.pipeline import pipeline

    summary = _start(
        settings,
        pipeline,
        prefect_server=server,
        source=source,
        config_file=_file(config),
        overrides=overrides or None,
        refresh=refresh,
    )
    _print_summary(summary, settings, as_json)


@app.command()
def tune(
    source: str = SourceOption,
    trials: int = typer.Option(8, "--trials", min=1, help="Trials to run (each a training run of up to max_epochs)."),
    space: Path | None = typer.Option(
        None, "--space", help="Search space file (YAML, see docs/training.md); default: the built-in space."
    ),
    time_budget: float | None = typer.Option(
        None, "--time-budget", min=1, help="Seconds the search may take; trials not started by then are not run."
    ),
    promote: bool = typer.Option(
        False, "--promote", help="Train the best trial's settings and promote them through the gate."
    ),
    as_json: bool = JsonOption,
    refresh: bool = RefreshOption,
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
) -> None:
    """Search the training settings for SOURCE with Ray Tune; print the trials and save the best ones as a settings
    file."""
    settings, overrides = _settings_or_exit(config, set_)
    server = _prefect_server(settings)
    from imagelake.flows.tune import tune_flow

    summary = _start(
        settings,
        tune_flow,
        prefect_server=server,
        source=source,
        trials=trials,
        space_file=str(space) if space else None,
        time_budget_s=time_budget,
        promote=promote,
        config_file=_file(config),
        overrides=overrides or None,
        refresh=refresh,
    )
    typer.echo(format_search(summary))
    if as_json:
        typer.echo(json.dumps(summary, sort_keys=True, default=str))


@app.command()
def backfill(
    start: datetime = typer.Argument(..., formats=["%Y-%m-%d"], help="First date (YYYY-MM-DD) of the range."),
    end: datetime = typer.Argument(..., formats=["%Y-%m-%d"], help="Last date (YYYY-MM-DD) of the range, included."),
    source: str = typer.Option(
        ..., "--source", help="Folder (or URI) of images laid out as date=YYYY-MM-DD/<label>/<file>."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the plan (missing, stale or done per date) and ingest nothing."
    ),
    max_concurrency: int = typer.Option(
        2, "--max-concurrency", min=1, help="Dates ingested at once, each as its own subflow run."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object on the last line."),
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
) -> None:
    """Ingest every date of START..END that is missing or stale, then train once on the resulting table version."""
    settings, overrides = _settings_or_exit(config, set_)
    try:  # before a Prefect server or the flow is started for it (the flow checks it again)
        check_date_range(start.date(), end.date())
    except ValueError as exc:
        _fail(exc)
    server = _prefect_server(settings)
    from imagelake.flows.backfill import BackfillFailed
    from imagelake.flows.backfill import backfill as backfill_flow

    try:
        result = _start(
            settings,
            backfill_flow,
            prefect_server=server,
            source=source,
            start_date=start.date(),
            end_date=end.date(),
            max_concurrency=max_concurrency,
            dry_run=dry_run,
            config_file=_file(config),
            overrides=overrides or None,
        )
    except BackfillFailed as exc:  # the other dates landed: exit 1, naming the dates to re-run
        typer.secho(f"error: {exc}", err=True, fg="red")
        raise typer.Exit(1) from None
    for item in result["plan"]:
        typer.echo(
            f"  {item['date']}  {item['status']:8} {item['files']} files, {item['new_or_changed']} new or "
            f"changed, {item['gone']} gone"
        )
    if "model_version" in result:
        typer.echo(
            f"trained on table version {result['delta_version']}: model v{result['model_version']} -> "
            f"{result['model_alias']}"
        )
    if as_json:
        typer.echo(json.dumps(result, sort_keys=True, default=str))


@app.command()
def maintain(config: Path | None = ConfigOption, set_: list[str] | None = SetOption) -> None:
    """Compact and vacuum the Delta tables (keeping every registered model's table version), clean the Petastorm cache
    and the workspace."""
    settings, overrides = _settings_or_exit(config, set_)
    server = _prefect_server(settings)
    from imagelake.flows.maintain import maintain as maintain_flow

    report = _start(
        settings, maintain_flow, prefect_server=server, config_file=_file(config), overrides=overrides or None
    )
    typer.echo(json.dumps(report, indent=2, default=str))


@app.command()
def requeue(
    reason: list[str] | None = typer.Option(
        None, "--reason", "-r", help="Only files quarantined for this reason (repeatable); default: every file."
    ),
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
) -> None:
    """Send quarantined files back through: the next run reads them again (a file still bad is quarantined again)."""
    settings, _ = _settings_or_exit(config, set_)
    from imagelake.tasks.data.table import ImageTable
    from imagelake.tasks.stages.write import requeue as requeue_files

    table = ImageTable.of(settings)
    held = table.quarantined_by_reason()
    unknown = [name for name in reason or [] if name not in held]
    if unknown:
        _fail(
            ValueError(
                f"--reason {', '.join(unknown)}: no file in the quarantine table {settings.quarantine_uri} has that "
                "reason; its reasons now: "
                f"{', '.join(f'{name} ({n})' for name, n in held.items()) or 'none (it is empty)'}"
            )
        )
    requeued = requeue_files(table, reason or None)
    if not requeued:
        typer.echo(f"nothing to requeue: the quarantine table {settings.quarantine_uri} is empty")
        return
    typer.echo(
        f"requeued {sum(requeued.values())} file(s) ({', '.join(f'{name}: {n}' for name, n in requeued.items())}); "
        "the next run reads them again"
    )


DOCTOR_ONLY_HELP = f"check only this part (repeatable): {', '.join(DOCTOR_PARTS)}"


@app.command()
def doctor(
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
    only: list[str] | None = typer.Option(None, "--only", help=DOCTOR_ONLY_HELP),
) -> None:
    """Check Python, Java, Spark, Delta, Petastorm, Ray, GPUs, MLflow and Prefect for these settings."""
    settings, _ = _settings_or_exit(config, set_)
    from imagelake.infra.console import new_log_path, send_library_output_to

    # What Spark, Ray and MLflow say as the checks start them goes to a log file, as for a run: the console holds the
    # checks' lines, and the last names the file.
    log = send_library_output_to(new_log_path(settings.workspace_dir, "doctor"))
    try:
        checks = run_checks(settings, only)
    except ValueError as exc:
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2) from None
    for check in checks:
        status = "ok" if check.ok else ("MISSING" if check.required else "absent")
        typer.echo(f"{status:8} {check.name:20} {check.detail}")
    typer.echo(f"{'log':8} {'':20} {log} (the libraries' own messages)")
    missing = [check for check in checks if check.required and not check.ok]
    if missing:
        typer.secho(
            f"missing: {', '.join(check.name for check in missing)} (see the lines above for what to do)",
            err=True,
            fg="red",
        )
        raise typer.Exit(1)
    typer.echo(f"everything {'checked' if only else 'imagelake needs'} is here")


def _registry_or_exit(config: Path | None, pairs: list[str] | None):
    settings, _ = _settings_or_exit(config, pairs)
    from imagelake.infra.tracking import mlflow_client

    return settings, mlflow_client(settings)


def _fail(exc: Exception) -> None:
    typer.secho(f"error: {exc}", err=True, fg="red")
    raise typer.Exit(2) from None


@app.command()
def lineage(
    model: str = typer.Argument(..., help="Registered model name."),
    version: str = typer.Argument(..., help="Model version."),
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
) -> None:
    """Print what a model version was trained on and with, and how to retrain on exactly that data."""
    _, client = _registry_or_exit(config, set_)
    from imagelake.tasks.registry.aliases import RegistryError
    from imagelake.tasks.registry.lineage import lineage as read_lineage

    try:
        found = read_lineage(client, model, version)
    except RegistryError as exc:
        _fail(exc)
    for key, value in found.items():
        typer.echo(f"{key:20} {value}")
    if found["delta_version"]:
        typer.echo(f"\nretrain on the same data:\n  imagelake retrain --model {model} --version {version}")


@app.command()
def retrain(
    model: str = typer.Option(..., "--model", help="Registered model name."),
    version: str = typer.Option(..., "--version", help="The version whose data and training settings to reuse."),
    as_json: bool = JsonOption,
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
) -> None:
    """Train again on exactly the Delta table version a model version was trained on, with its training settings."""
    settings, client = _registry_or_exit(config, set_)
    server = _prefect_server(settings)
    from imagelake.flows.pipeline import retrain_flow
    from imagelake.tasks.registry.aliases import RegistryError
    from imagelake.tasks.registry.lineage import lineage as read_lineage
    from imagelake.tasks.registry.lineage import retrain_overrides

    try:
        found = read_lineage(client, model, version)
        overrides = {**retrain_overrides(found), **parse_overrides(set_)}
    except RegistryError as exc:
        _fail(exc)
    summary = _start(
        settings,
        retrain_flow,
        (RegistryError,),
        prefect_server=server,
        table_uri=found["delta_table"],
        table_version=int(found["delta_version"]),
        config_file=_file(config),
        overrides=overrides,
    )
    _print_summary(summary, settings, as_json)


@app.command()
def rollback(
    model: str = typer.Option(..., "--model", help="Registered model name."),
    reason: str = typer.Option("operator rollback", "--reason", help="Why (recorded in the alias history)."),
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
) -> None:
    """Move `champion` back to `previous-champion` (the two swap)."""
    settings, client = _registry_or_exit(config, set_)
    from imagelake.tasks.registry.aliases import RegistryError
    from imagelake.tasks.registry.moves import rollback as do_rollback

    try:
        before, after = do_rollback(client, settings, model, reason)
    except RegistryError as exc:
        _fail(exc)
    typer.echo(f"{model}: champion v{before or '-'} -> v{after} (previous-champion is now v{before or '-'})")


@app.command()
def promote(
    model: str = typer.Option(..., "--model", help="Registered model name."),
    version: str = typer.Option(..., "--version", help="The version to make champion."),
    reason: str = typer.Option(..., "--reason", help="Why (recorded in the alias history)."),
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
) -> None:
    """Make a version champion by hand, bypassing the gate; the replaced champion becomes previous-champion."""
    settings, client = _registry_or_exit(config, set_)
    from imagelake.tasks.registry.aliases import RegistryError
    from imagelake.tasks.registry.moves import force_promote

    try:
        force_promote(client, settings, model, version, reason)
    except RegistryError as exc:
        _fail(exc)
    typer.echo(f"{model}: champion -> v{version} ({reason})")


@app.command()
def history(
    model: str = typer.Option(..., "--model", help="Registered model name."),
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
) -> None:
    """Every alias move of a model: when, who, which alias, from which version to which, and why."""
    settings, _ = _settings_or_exit(config, set_)
    from imagelake.tasks.registry.moves import history as read_history

    for row in read_history(settings, model):
        typer.echo(
            f"{row['at']:%Y-%m-%d %H:%M:%S} {row['who']:10} {row['alias']:18} v{row['from_version'] or '-'} "
            f"-> v{row['to_version']}  [{row['action']}] {row['reason']}"
        )


@app.command()
def predict(
    model: str = typer.Option(..., "--model", help="NAME@ALIAS or NAME/VERSION, e.g. imagelake-classifier@champion."),
    source: Path = typer.Option(..., "--source", help="An image file or a folder of images (searched recursively)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per image instead of text."),
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
) -> None:
    """Label images with a registered model, resized exactly as for training."""
    settings, client = _registry_or_exit(config, set_)
    from imagelake.tasks.inference.cli_serving import predict_files
    from imagelake.tasks.registry.aliases import RegistryError

    try:
        results = predict_files(client, settings, model, source)
    except (RegistryError, FileNotFoundError) as exc:
        _fail(exc)
    for result in results:
        typer.echo(
            json.dumps(result)
            if as_json
            else f"{result['path']}\t{result['label']}\t{result['probability']:.3f}"
            + (f"\t{result['error']}" if result.get("error") else "")
        )


@app.command()
def score(
    model: str = typer.Option(..., "--model", help="NAME@ALIAS or NAME/VERSION, e.g. imagelake-classifier@champion."),
    source: str = typer.Option(
        ...,
        "--source",
        help=(
            "A folder or object-store prefix of images (any layout), or a Delta table of images: its URI, with "
            "@VERSION for an older version."
        ),
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    config: Path | None = ConfigOption,
    set_: list[str] | None = SetOption,
) -> None:
    """Label a folder, prefix or table version on Spark with a registered model, into the Delta table `predictions`."""
    settings, overrides = _settings_or_exit(config, set_)
    server = _prefect_server(settings)
    from imagelake.flows.score import score_flow
    from imagelake.tasks.registry.aliases import RegistryError

    result = _start(
        settings,
        score_flow,
        (RegistryError,),
        prefect_server=server,
        model=model,
        source=source,
        config_file=_file(config),
        overrides=overrides,
    )
    if as_json:
        typer.echo(json.dumps(result))
        return
    where = (
        f"{result['predictions_uri']} version {result['predictions_version']}"
        if result["predictions_version"] is not None
        else "nothing new to write"
    )
    if result["result_reused"]:
        where += " (the source has not changed since the last run with this version)"
    typer.echo(
        f"{result['model']}: {result['answered']} of {result['images']} images answered ({result['errors']} "
        f"not images) -> {where}"
    )


@app.command("demo-data")
def demo_data(
    out: Path = typer.Argument(..., help="Folder to write OUT/<label>/<id>.png into."),
    size: int = typer.Option(64, help="Side of the written PNGs in pixels (the digits are 8x8)."),
    per_label: int | None = typer.Option(None, help="Write at most this many images of each digit (or photo)."),
    photos: bool = typer.Option(
        False,
        "--photos",
        help="Real photographs instead: random crops of scikit-learn's two sample photos, 300-1,600 px JPEGs.",
    ),
) -> None:
    """Write scikit-learn's handwritten digits as PNG files (or, with --photos, crops of its sample photos as JPEGs) in
    ImageFolder layout."""
    from imagelake.flows.demo_data import write_digits, write_photos

    count = (
        write_photos(out, per_label=per_label or 150) if photos else write_digits(out, size=size, per_label=per_label)
    )
    typer.echo(f"wrote {count} images to {out}")


if __name__ == "__main__":
    app()
