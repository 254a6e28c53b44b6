"""What a command shows on the console, and where the libraries' own messages go instead: a log file in the workspace.

A command that runs a flow (`imagelake run`, `backfill`, `score`, ...) prints its stages' lines, progress and summary.
The libraries it drives have their own start-up and housekeeping messages (Spark's JVM: the native-library warning and
its log level notice; Ray's start; MLflow's database set-up, its input-example check and its download progress bars).
Those go to one log file per command, under the workspace's logs/ folder, which the summary names:
  - the Python loggers of the libraries (LIBRARY_LOGGERS) write to the file only; MLflow is told not to configure its
    own handlers (MLFLOW_CONFIGURE_LOGGING), and Ray's, which Ray adds when imported, are replaced when it starts
    (infra/ray_runtime.py calls `claim_loggers`);
  - MLflow's artifact progress bars are off (MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR), and what it prints when it
    registers a model goes to the file (`library_prints`);
  - the Spark driver's JVM logs through a log4j2 configuration that appends to the same file (`spark_java_option`).
Warnings (Python's `warnings`) still reach the console: one that shows is a defect to fix at its cause. A record that
carries a traceback (Prefect's "Encountered exception" when a stage fails) shows on the console as its line alone, which
names the log file; the file gets the record whole (`tracebacks_to_file`). The command's own error says what to do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

LOG_FOLDER = "logs"
LIBRARY_LOGGERS = (
    "mlflow",
    "alembic",
    "ray",
    "py4j",
    "pyspark",
    "petastorm",
    "pytorch_lightning",
    "lightning",
    "torch",
    "urllib3",
    "filelock",
    "fsspec",
    "matplotlib",
    "PIL",
    "git",
)
# Their start-up steps, kept at INFO in the file (what started, and where); the others at their own levels.
INFO_LOGGERS = ("mlflow", "ray")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_log: dict[str, logging.Handler | Path] = {}


def log_file() -> Path | None:
    """The log file this process's library messages go to, once `send_library_output_to` has named one."""
    found = _log.get("path")
    return found if isinstance(found, Path) else None


def new_log_path(workspace: Path, command: str) -> Path:
    """A log file of its own for one command: WORKSPACE/logs/COMMAND-<UTC time>-<pid>.log."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return workspace / LOG_FOLDER / f"{command}-{stamp}-{os.getpid()}.log"


def send_library_output_to(path: Path) -> Path:
    """From now on, this process's library messages go to PATH (created, appended to) and not to the console."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT))
    _log.update(path=path, handler=handler)
    # Read by MLflow when it is first imported (the command imports it later, with its flow).
    os.environ["MLFLOW_CONFIGURE_LOGGING"] = "false"
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    claim_loggers()
    return path


def claim_loggers(*names: str) -> None:
    """Point the library loggers (or NAMES) at the log file, once one is named; a library that added a console
    handler of its own when imported (Ray) loses it here."""
    handler = _log.get("handler")
    if not isinstance(handler, logging.Handler):
        return
    for name in names or LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False
        if name in INFO_LOGGERS:
            logger.setLevel(logging.INFO)


class TracebackToFile(logging.Formatter):
    """A console handler's formatter that writes a record with a traceback to the log file whole, and shows its line
    alone, naming the file."""

    def __init__(self, inner: logging.Formatter, file_handler: logging.Handler, path: Path) -> None:
        super().__init__()
        self.inner, self.file_handler, self.path = inner, file_handler, path

    def format(self, record: logging.LogRecord) -> str:
        if not (record.exc_info or record.exc_text or record.stack_info):
            return self.inner.format(record)
        self.file_handler.handle(record)
        line = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None, "stack_info": None})
        return f"{self.inner.format(line)} (traceback in {self.path})"


def tracebacks_to_file() -> None:
    """The root logger's console handlers (Prefect's) show tracebacks as a pointer to the log file, once one is named.
    Called after Prefect has set up its logging (its import does)."""
    handler, path = _log.get("handler"), log_file()
    if not isinstance(handler, logging.Handler) or path is None:
        return
    for console in logging.getLogger().handlers:
        if console is handler or isinstance(console, logging.FileHandler):
            continue
        inner = console.formatter or logging.Formatter()
        if isinstance(inner, TracebackToFile):
            inner = inner.inner
        console.setFormatter(TracebackToFile(inner, handler, path))


@contextlib.contextmanager
def library_prints() -> Iterator[None]:
    """What a library prints to sys.stderr meanwhile (MLflow's "Successfully registered model" and "Created version"
    lines) goes to the log file, where one is named. Loggers keep the streams they were given: the stages' lines
    still reach the console."""
    path = log_file()
    if path is None:
        yield
        return
    with path.open("a", encoding="utf-8") as out, contextlib.redirect_stderr(out):
        yield
    sys.stderr.flush()


def spark_java_option(folder: Path | None = None) -> str:
    """The Spark driver's JVM option that sends its log to the log file ("" when none is named): a log4j2
    configuration written next to it. Spark's own default configuration prints to the console."""
    path = log_file()
    if path is None:
        return ""
    config = (folder or path.parent) / f"{path.stem}.log4j2.properties"
    config.write_text(
        "\n".join(
            [
                "rootLogger.level = warn",
                "rootLogger.appenderRef.file.ref = file",
                "appender.file.type = File",
                "appender.file.name = file",
                f"appender.file.fileName = {path}",
                "appender.file.append = true",
                "appender.file.layout.type = PatternLayout",
                "appender.file.layout.pattern = %d{yyyy-MM-dd HH:mm:ss,SSS} %p %c: %m%n%ex",
                "",
            ]
        ),
        encoding="utf-8",
    )
    return f"-Dlog4j2.configurationFile={config.as_uri()}"
