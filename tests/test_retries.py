"""Stage retries: a transient failure is retried and the run completes; a permanent one fails after one attempt. The
classifier on errors as Pillow, Arrow, fsspec and the S3 clients raise them: bad bytes, a file gone, S3 throttling."""

from __future__ import annotations

import errno
import io
import struct
import urllib.request
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import botocore.config
import botocore.session
import fsspec
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import s3fs
from botocore.exceptions import ClientError
from PIL import Image, UnidentifiedImageError
from prefect import flow
from prefect.cache_policies import NO_CACHE
from pyarrow.fs import AwsStandardS3RetryStrategy, S3FileSystem
from ray.train import WorkerGroupError

from imagelake.infra.settings import SettingsError
from imagelake.infra.weights import WeightsUnavailable
from imagelake.tasks.data.resize_executor import read_with_retries
from imagelake.tasks.rules.bad_files import TooManyBadFiles
from imagelake.tasks.stage import is_permanent, stage
from imagelake.tasks.worker.train_loop import CheckpointUnusable
from tests.s3 import SlowDownServer

ERRORS = {
    "transient": OSError("the object store timed out"),
    "bad settings": SettingsError("image_size must be positive"),
    "too many bad files": TooManyBadFiles("3 of 3 files are bad (not_an_image: 3), over max_bad_fraction=0.2"),
    "unusable checkpoint": CheckpointUnusable("no checkpoint under ray_results/run loads: delete that folder"),
    # How a training worker's error reaches the driver: inside Ray Train's error, by rank.
    "unusable checkpoint on a worker": WorkerGroupError(
        "Training failed", {1: CheckpointUnusable("no checkpoint loads: delete the run folder")}
    ),
    "weights unavailable": WeightsUnavailable("pretrained=IMAGENET1K_V1: mobilenet_v2-b0353104.pth is missing"),
    "weights unavailable on a worker": WorkerGroupError(
        "Training failed", {0: WeightsUnavailable("pretrained=IMAGENET1K_V1: the cached file is not the published one")}
    ),
}


def attempts(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@stage("flaky", retries=2, backoff=0.05, cache_policy=NO_CACHE)
def flaky(log: str, error: str) -> str:
    """Fails on its first attempt with `error`, then succeeds."""
    path = Path(log)
    with path.open("a") as out:
        out.write("attempt\n")
    if attempts(path) == 1:
        raise ERRORS[error]
    return "done"


@flow
def one_stage(log: str, error: str) -> str:
    return flaky(log, error)


def test_a_transient_failure_is_retried_and_the_run_completes(prefect_api: str, tmp_path: Path) -> None:
    log = tmp_path / "transient.log"
    assert one_stage(str(log), "transient") == "done"
    assert attempts(log) == 2


@pytest.mark.parametrize(
    "error",
    [
        "bad settings",
        "too many bad files",
        "unusable checkpoint",
        "unusable checkpoint on a worker",
        "weights unavailable",
        "weights unavailable on a worker",
    ],
)
def test_a_permanent_failure_fails_after_one_attempt(prefect_api: str, tmp_path: Path, error: str) -> None:
    log = tmp_path / "permanent.log"
    with pytest.raises(type(ERRORS[error]), match=str(ERRORS[error]).split(" ")[0]):
        one_stage(str(log), error)
    assert attempts(log) == 1


def test_missing_pretrained_weights_fail_the_run_before_its_first_stage_naming_the_file_and_what_to_do(
    prefect_api: str, tmp_path: Path, digits_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found when the run's settings are read: no stage starts (no Spark, no listing), nothing is written, and the
    error names the file, the cache folder, `make install` and pretrained=none."""
    from imagelake.flows.pipeline import pipeline
    from imagelake.infra.spark import spark_asks
    from imagelake.tasks.stage import stage_outcomes

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # an empty cache, and no download: a closed proxy
    for name in ("https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    urllib.request.install_opener(None)
    asked = spark_asks()
    workspace = tmp_path / "ws"
    overrides = {"workspace": str(workspace), "model_arch": "mobilenet_v2", "pretrained": "IMAGENET1K_V1"}
    try:
        state = pipeline(source=str(digits_dir), overrides=overrides, return_state=True)
    finally:
        urllib.request.install_opener(None)
    assert state.is_failed()
    with pytest.raises(WeightsUnavailable) as failed:
        state.result()
    message = str(failed.value)
    for expected in ("mobilenet_v2-b0353104.pth", str(tmp_path / "torch" / "hub" / "checkpoints"), "make install"):
        assert expected in message, expected
    assert "pretrained=none" in message
    assert stage_outcomes(str(state.state_details.flow_run_id)) == ({}, {}), "no stage started"
    assert spark_asks() == asked and not (workspace / "tables").exists()


@stage("writes-a-file", needs=lambda written: [written])
def writes_a_file(path: str, settings) -> str:
    with Path(path).with_suffix(".calls").open("a") as out:
        out.write("call\n")
    Path(path).write_text("the stage's output")
    return path


@flow
def one_stage_flow(stage_name: str, path: str, settings) -> dict:
    """Run one of this file's stages on PATH; how it ended and why it was a hit or a miss."""
    from prefect.context import FlowRunContext

    from imagelake.infra.prefect_env import stage_results
    from imagelake.tasks.stage import stage_outcomes

    with stage_results(settings):
        {"writes-a-file": writes_a_file, "reads-what-it-can": reads_what_it_can}[stage_name](path, settings)
    states, reasons = stage_outcomes(str(FlowRunContext.get().flow_run.id))
    return {"state": states[stage_name], "why": reasons[stage_name]}


def file_flow(path: str, settings) -> dict:
    return one_stage_flow("writes-a-file", path, settings)


def test_a_cached_result_whose_file_is_gone_is_a_miss_that_says_why(prefect_api: str, tmp_path: Path) -> None:
    from imagelake.infra.settings import load_settings

    settings = load_settings(overrides={"workspace": str(tmp_path / "ws")})
    output = tmp_path / "out.txt"
    assert file_flow(str(output), settings)["state"] == "Completed"
    assert file_flow(str(output), settings)["state"] == "Cached"
    output.unlink()  # a cleaned disk, a moved workspace
    again = file_flow(str(output), settings)
    assert again["state"] == "Completed" and output.exists()
    assert again["why"] == f"stored result changed None -> needs {output}, which is gone"
    assert file_flow(str(output), settings)["state"] == "Cached", "the new result is reused from then on"
    assert len(output.with_suffix(".calls").read_text().splitlines()) == 2


@stage(
    "reads-what-it-can", unfinished=lambda left: f"{left} file(s) could not be read then; read again" if left else None
)
def reads_what_it_can(path: str, settings) -> int:
    with Path(path).with_suffix(".calls").open("a") as out:
        out.write("call\n")
    return int(Path(path).read_text())  # files this call could not read


def reading_flow(path: str, settings) -> dict:
    return one_stage_flow("reads-what-it-can", path, settings)


def test_a_cached_result_that_left_files_unread_is_a_miss_until_none_are(prefect_api: str, tmp_path: Path) -> None:
    from imagelake.infra.settings import load_settings

    settings = load_settings(overrides={"workspace": str(tmp_path / "ws")})
    left = tmp_path / "left.txt"
    left.write_text("2")
    assert reading_flow(str(left), settings)["state"] == "Completed"
    again = reading_flow(str(left), settings)
    assert again["state"] == "Completed", "a result that left files unread is not reused: the next run reads them"
    assert again["why"] == "stored result changed None -> 2 file(s) could not be read then; read again"
    left.write_text("0")  # the store is back
    assert reading_flow(str(left), settings)["state"] == "Completed"
    assert reading_flow(str(left), settings)["state"] == "Cached", "a complete result is reused from then on"
    assert len(left.with_suffix(".calls").read_text().splitlines()) == 3


# --- The classifier on errors as the libraries raise them ----------------------------------------------------------


def raised(call: Callable[[], object]) -> BaseException:
    """The error CALL raises, as the library raised it (its cause and context included)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - whatever it raises is the error under test
        return exc
    raise AssertionError(f"{call} raised nothing")


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims WIDTH x HEIGHT pixels: Pillow refuses a bomb from its header, before any pixel."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IEND", b"")
    )


# Errors about a file's bytes, and the type each library raises: the same bytes fail the same way on every attempt.
BAD_BYTES: dict[str, tuple[Callable[[], object], type[BaseException]]] = {
    "Pillow: not an image": (
        lambda: Image.open(io.BytesIO(b"<html>an error page saved as a .png</html>")),
        UnidentifiedImageError,
    ),
    "Pillow: a decompression bomb": (
        lambda: Image.open(io.BytesIO(png_claiming(20_000, 20_000))),
        Image.DecompressionBombError,
    ),
    "Arrow: not Parquet": (lambda: pq.read_table(pa.BufferReader(b"half a Parquet file")), pa.ArrowInvalid),
}


@pytest.mark.parametrize("case", list(BAD_BYTES))
def test_an_error_about_the_files_bytes_is_permanent(case: str) -> None:
    """A retry reads the same bytes and fails again: one attempt."""
    call, kind = BAD_BYTES[case]
    error = raised(call)
    assert type(error) is kind, f"{case}: {type(error).__name__}: {error}"
    assert is_permanent(error), f"{case}: {type(error).__module__}.{type(error).__name__} ({error}) would be retried"


def parquet_bytes(n: int) -> bytes:
    """A one-row Parquet file."""
    out = pa.BufferOutputStream()
    pq.write_table(pa.table({"n": [n]}), out)
    return out.getvalue().to_pybytes()


def deleted_after_listing(folder: str) -> dict[str, BaseException]:
    """Three files under FOLDER (a path or an s3:// URI) listed, then one of them deleted before it is read: the errors
    of the reads that meet the gap, by reader (the resize stage's, and Arrow's over a dataset it listed, as the write
    stage lists the staged rows)."""
    fs, root = fsspec.core.url_to_fs(folder)
    fs.makedirs(root, exist_ok=True)
    for n in range(3):
        fs.pipe_file(f"{root}/{n}.parquet", parquet_bytes(n))
    dataset = ds.dataset(folder, format="parquet")
    fs.rm(f"{root}/1.parquet")
    return {
        "fsspec": raised(lambda: read_with_retries(f"{folder}/1.parquet", 3, 0.0)),
        "Arrow": raised(dataset.to_table),
    }


def test_a_file_deleted_between_its_listing_and_its_read_is_permanent(tmp_path: Path) -> None:
    """A retry reads the same listing and misses the same file again (resize counts such a file unread instead, and the
    next run's listing finds it or not): one attempt."""
    for reader, error in deleted_after_listing(str(tmp_path / "files")).items():
        assert is_permanent(error), (
            f"{reader}: {type(error).__module__}.{type(error).__name__} ({error}) would be retried"
        )


def test_a_key_deleted_on_s3_between_its_listing_and_its_read_is_permanent(s3) -> None:
    """The same gap on S3 (S3Proxy answers 404 NoSuchKey) is the same failure as on a disk, whichever client meets
    it."""
    for reader, error in deleted_after_listing(f"s3://lake/{uuid.uuid4().hex[:12]}").items():
        assert is_permanent(error), (
            f"{reader}: {type(error).__module__}.{type(error).__name__} ({error}) would be retried"
        )


@pytest.fixture(scope="module")
def slow_down() -> Iterator[str]:
    """An S3 endpoint that answers every request 503 SlowDown."""
    with SlowDownServer() as endpoint:
        yield endpoint


def botocore_get(endpoint: str) -> None:
    no_retries = botocore.config.Config(retries={"max_attempts": 1, "mode": "standard"})
    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="key",
        aws_secret_access_key="secret",
        region_name="us-east-1",
        config=no_retries,
    )
    client.get_object(Bucket="lake", Key="a.png")


def s3fs_read(endpoint: str) -> None:
    fs = s3fs.S3FileSystem(
        key="key",
        secret="secret",
        skip_instance_cache=True,
        client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
        config_kwargs={"retries": {"max_attempts": 1, "mode": "standard"}},
    )
    fs.retries = 1
    fs.cat_file("lake/a.png")


def arrow_read(endpoint: str) -> None:
    store = S3FileSystem(
        access_key="key",
        secret_key="secret",
        endpoint_override=endpoint.removeprefix("http://"),
        scheme="http",
        region="us-east-1",
        retry_strategy=AwsStandardS3RetryStrategy(max_attempts=1),
    )
    pq.read_table("lake/a.parquet", filesystem=store)


def is_slow_down(error: BaseException) -> bool:
    """Whether ERROR is S3's 503, as botocore reports it or as s3fs and Arrow pass it on."""
    if isinstance(error, ClientError):
        return error.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    return isinstance(error, OSError) and (
        (error.errno == errno.EBUSY and is_slow_down(error.__cause__)) or "HTTP status 503" in str(error)
    )


# Each client with no retries of its own: the error is what reaches the stage once the library gives up.
SLOW_DOWN_CLIENTS = {"botocore": botocore_get, "s3fs": s3fs_read, "Arrow's S3": arrow_read}


@pytest.mark.parametrize("client", list(SLOW_DOWN_CLIENTS))
def test_an_s3_slow_down_is_transient(slow_down: str, client: str) -> None:
    """S3 throttles a prefix that gets more requests than it takes: a later attempt, after a backoff, passes."""
    error = raised(lambda: SLOW_DOWN_CLIENTS[client](slow_down))
    assert is_slow_down(error), f"{client}: {type(error).__name__}: {error}"
    assert not is_permanent(error), f"{client}: {type(error).__name__} ({error}) would fail the stage at once"
