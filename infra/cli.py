"""The `imagelake` command: run the pipeline, check the machine, write demo data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from infra.settings import Settings, SettingsError, load_settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train image models on a lakehouse.")

ConfigOption = typer.Option(None, "--config", "-c", help="Settings file (.yaml, .toml or .json); IMAGELAKE_* variables override it.")
SetOption = typer.Option(None, "--set", "-s", help="Override one setting: NAME=VALUE (repeatable), e.g. --set max_epochs=3.")


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


def _settings_or_exit(config: Optional[Path], pairs: list[str] | None) -> tuple[Settings, dict[str, Any]]:
    try:
        overrides = parse_overrides(pairs)
        return load_settings(config, overrides), overrides
    except SettingsError as exc:
        typer.secho(f"error: {exc}", err=True, fg="red")
        raise typer.Exit(2) from None


@app.command()
def run(
    source: str = typer.Option(..., "--source", help="Folder (or URI) of images laid out as <label>/<file>."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object on the last line."),
    config: Optional[Path] = ConfigOption,
    set_: Optional[list[str]] = SetOption,
) -> None:
    """Run the whole pipeline on SOURCE and print a summary."""
    settings, overrides = _settings_or_exit(config, set_)
    from flows.pipeline import pipeline
    from infra.prefect_env import prefect_for

    try:
        with prefect_for(settings):
            summary = pipeline(source=source, config_file=str(config) if config else None, overrides=overrides or None)
    except (ValueError, FileNotFoundError) as exc:
        # Bad input or settings: the message says what to do; the traceback is in the log above.
        typer.secho(f"error: {exc}", err=True, fg="red")
        raise typer.Exit(2) from None
    typer.echo(format_summary(summary))
    if as_json:
        typer.echo(json.dumps(summary, sort_keys=True))


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines a person reads after a run."""
    return "\n".join(
        [
            f"imagelake run {summary.get('flow_run_id')}",
            f"  Delta table   {summary['delta_table']} v{summary['delta_version']} ({summary['rows']} images, "
            f"{summary['rows_added']} added, {summary['rows_retired']} retired, writer {summary['delta_engine']})",
            f"  files         {summary['files_decoded']} decoded, {summary['files_known']} already known, "
            f"quarantined {summary['quarantined'] or 'none'}",
            f"  splits        {summary['split_counts']}",
            f"  cache         {summary['cache_dir']}",
            f"  training      {summary['epochs_run']} epochs, val accuracy {summary['val_accuracy']:.3f}, MLflow run {summary['mlflow_run_id']}",
            f"  model         {summary['model_name']} v{summary['model_version']} -> {summary['model_alias']} "
            f"(test accuracy {summary['test_accuracy']:.3f}; champion is v{summary['champion_version']})",
        ]
    )


@app.command()
def maintain(config: Optional[Path] = ConfigOption, set_: Optional[list[str]] = SetOption) -> None:
    """Compact and vacuum the Delta tables (keeping every registered model's table version)."""
    settings, overrides = _settings_or_exit(config, set_)
    from flows.maintenance import maintenance
    from infra.prefect_env import prefect_for

    with prefect_for(settings):
        report = maintenance(config_file=str(config) if config else None, overrides=overrides or None)
    typer.echo(json.dumps(report, indent=2, default=str))


@app.command()
def doctor(config: Optional[Path] = ConfigOption, set_: Optional[list[str]] = SetOption) -> None:
    """Check Python, Java, Spark, Delta, Petastorm, Ray, GPUs, MLflow and Prefect for these settings."""
    settings, _ = _settings_or_exit(config, set_)
    from infra.doctor import run_checks

    checks = run_checks(settings)
    for check in checks:
        status = "ok" if check.ok else ("MISSING" if check.required else "absent")
        typer.echo(f"{status:8} {check.name:20} {check.detail}")
    missing = [check for check in checks if check.required and not check.ok]
    if missing:
        typer.secho(f"missing: {', '.join(check.name for check in missing)} (see the lines above for what to do)", err=True, fg="red")
        raise typer.Exit(1)
    typer.echo("everything imagelake needs is here")


@app.command("demo-data")
def demo_data(
    out: Path = typer.Argument(..., help="Folder to write OUT/<label>/<id>.png into."),
    size: int = typer.Option(64, help="Side of the written PNGs in pixels (the digits are 8x8)."),
    per_label: Optional[int] = typer.Option(None, help="Write at most this many images of each digit."),
) -> None:
    """Write scikit-learn's handwritten digits as PNG files in ImageFolder layout."""
    from tasks.demo_data import write_digits

    count = write_digits(out, size=size, per_label=per_label)
    typer.echo(f"wrote {count} images to {out}")


if __name__ == "__main__":
    app()
