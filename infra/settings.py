"""The one typed settings model: IMAGELAKE_* environment variables, an optional config file, defaults for one
machine."""

from __future__ import annotations

import contextvars
import json
import tomllib
from datetime import date
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from imagelake.infra.declare import (
    DECODER_GUARD,
    WHERE_DATA_LIVES,
    WHERE_IT_CONNECTS,
    WHOSE_MODEL,
    WORKERS_SPARK,
    in_keys_of,
    setting,
    stage_fields,
)
from imagelake.infra.secret_checks import has_password, names_a_secret

_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("imagelake_config_file", default=None)


class SettingsError(ValueError):
    """Settings that cannot be used; the message names the field or file and what to do."""


class _ConfigFileSource(PydanticBaseSettingsSource):
    """Reads the optional YAML, TOML or JSON config file named by load_settings()."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _config_file.get()
        if path is None:
            return {}
        return read_config_file(path)


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a settings file by its suffix (.yaml/.yml, .toml or .json) into a dict."""
    if not path.is_file():
        raise SettingsError(f"config file {path} does not exist: pass an existing .yaml, .toml or .json file")
    text = path.read_text()
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        data = yaml.safe_load(text) or {}
    elif suffix == ".toml":
        data = tomllib.loads(text)
    elif suffix == ".json":
        data = json.loads(text)
    else:
        raise SettingsError(f"config file {path}: unknown suffix {suffix!r}; use .yaml, .toml or .json")
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of setting names to values")
    return data


# small_cnn and torchvision's classification models (torchvision.models.list_models(module=torchvision.models) for the
# pinned torchvision; tests/test_models.py fails when they differ). Listed here, a Literal: the settings load without
# importing torchvision, and the Prefect UI's form offers them as a list.
MODEL_ARCHS = (
    "small_cnn",
    "alexnet",
    "convnext_base",
    "convnext_large",
    "convnext_small",
    "convnext_tiny",
    "densenet121",
    "densenet161",
    "densenet169",
    "densenet201",
    "efficientnet_b0",
    "efficientnet_b1",
    "efficientnet_b2",
    "efficientnet_b3",
    "efficientnet_b4",
    "efficientnet_b5",
    "efficientnet_b6",
    "efficientnet_b7",
    "efficientnet_v2_l",
    "efficientnet_v2_m",
    "efficientnet_v2_s",
    "googlenet",
    "inception_v3",
    "maxvit_t",
    "mnasnet0_5",
    "mnasnet0_75",
    "mnasnet1_0",
    "mnasnet1_3",
    "mobilenet_v2",
    "mobilenet_v3_large",
    "mobilenet_v3_small",
    "regnet_x_16gf",
    "regnet_x_1_6gf",
    "regnet_x_32gf",
    "regnet_x_3_2gf",
    "regnet_x_400mf",
    "regnet_x_800mf",
    "regnet_x_8gf",
    "regnet_y_128gf",
    "regnet_y_16gf",
    "regnet_y_1_6gf",
    "regnet_y_32gf",
    "regnet_y_3_2gf",
    "regnet_y_400mf",
    "regnet_y_800mf",
    "regnet_y_8gf",
    "resnet101",
    "resnet152",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnext101_32x8d",
    "resnext101_64x4d",
    "resnext50_32x4d",
    "shufflenet_v2_x0_5",
    "shufflenet_v2_x1_0",
    "shufflenet_v2_x1_5",
    "shufflenet_v2_x2_0",
    "squeezenet1_0",
    "squeezenet1_1",
    "swin_b",
    "swin_s",
    "swin_t",
    "swin_v2_b",
    "swin_v2_s",
    "swin_v2_t",
    "vgg11",
    "vgg11_bn",
    "vgg13",
    "vgg13_bn",
    "vgg16",
    "vgg16_bn",
    "vgg19",
    "vgg19_bn",
    "vit_b_16",
    "vit_b_32",
    "vit_h_14",
    "vit_l_16",
    "vit_l_32",
    "wide_resnet101_2",
    "wide_resnet50_2",
)


# Every field is declared once, with setting() (infra/declare.py): its section, type, default, bounds and description,
# the stages whose keys it enters, and whether a run started from a deployment may set it (runs=, cap=, why=).
# infra/run_policy.py, stage_settings() (each @stage's settings), a model's reproducing settings and docs/settings.md
# are derived from the declarations; tests/test_settings.py fails for a field declared without them.
class Settings(BaseSettings):
    """Where imagelake runs and how; every field is also IMAGELAKE_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="IMAGELAKE_", extra="forbid", validate_default=True)

    workspace: Path = setting(
        section="lake",
        default=Path(".imagelake"),
        description="Folder of everything embedded: tables, cache, staging, stage results, MLflow's store, unless set",
        stages=(),
        runs="refused",
        why=WHERE_DATA_LIVES,
    )

    spark_master: str = setting(
        section="spark",
        default="local[*]",
        description="Spark master URL: local[*] embedded, spark://host:port for a standalone cluster",
        stages=(),
        runs="refused",
        why=WHERE_IT_CONNECTS,
    )
    spark_driver_memory: str = setting(
        section="spark",
        default="4g",
        description="Memory of an embedded Spark's driver JVM (Spark's form: 4g)",
        stages=(),
        runs="refused",
        why=WORKERS_SPARK,
    )
    spark_log_level: Literal["ALL", "DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF"] = setting(
        section="spark",
        default="ERROR",
        description="Spark's own log level",
        stages=(),
        runs="allowed",
    )
    spark_jars: list[str] = setting(
        section="spark",
        default_factory=list,
        description="Extra jars for Spark, e.g. Delta's, as local paths",
        stages=(),
        runs="refused",
        why=WORKERS_SPARK,
    )
    jars_dir: Path | None = setting(
        section="spark",
        default=None,
        description=(
            "Folder of the Delta and S3A jars (and the driver's class archive) given to Spark; default: jars/ in "
            "the Python environment, where `make install` puts them"
        ),
        stages=(),
        runs="refused",
        why=WORKERS_SPARK,
    )
    spark_conf: dict[str, str] = setting(
        section="spark",
        default_factory=dict,
        description="Extra Spark properties, applied last (e.g. spark.kubernetes.*, spark.executor.*)",
        stages=(),
        runs="refused",
        why=WORKERS_SPARK,
    )
    delta_writer: Literal["auto", "delta-rs", "spark"] = setting(
        section="spark",
        default="auto",
        description=(
            "Delta engine for reads, merges, compaction and vacuum: auto is delta-rs on an embedded Spark and Spark's "
            "Delta on a Spark cluster with Delta's jars"
        ),
        stages=("write",),
        runs="refused",
        why=WORKERS_SPARK,
    )
    spark_merge_min_rows: int | None = setting(
        section="spark",
        default=2000,
        ge=1,
        description=(
            "With delta_writer=auto on an embedded Spark: a merge of more new rows than this goes through Spark's "
            "Delta where its jars load, whose executors read them (delta-rs holds a merge's rows in the driver); "
            "none: never"
        ),
        stages=(),
        runs="refused",
        why=WORKERS_SPARK,
    )
    table_root: str | None = setting(
        section="lake",
        default=None,
        description="Folder or object-store URI of the Delta tables",
        stages=(),
        runs="refused",
        why=WHERE_DATA_LIVES,
    )
    table_name: str = setting(
        section="lake",
        default="images",
        description="Name of the images table under table_root",
        stages=(),
        runs="refused",
        why=WHERE_DATA_LIVES,
    )

    image_size: int = setting(
        section="ingest",
        default=160,
        ge=8,
        le=2048,
        description="Side of the square images stored and trained on (160: the pretrained default's measured size)",
        stages=("resize", "split", "cache"),
        runs="allowed",
    )
    resize_mode: Literal["letterbox", "center_crop"] = setting(
        section="ingest",
        default="letterbox",
        description="How an image becomes a square: letterbox pads the short side, center_crop cuts the long one",
        stages=("resize", "promote"),
        runs="allowed",
    )
    image_extensions: list[str] = setting(
        section="ingest",
        default_factory=lambda: [".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"],
        description="File endings that count as images (any case); other files are left out of the listing",
        stages=("ingest", "score"),
        runs="allowed",
    )

    start_date: date | None = setting(
        section="ingest",
        default=None,
        description="Only source files of dates on or after this one",
        stages=("ingest", "resize"),
        runs="allowed",
    )
    end_date: date | None = setting(
        section="ingest",
        default=None,
        description="Only source files of dates on or before this one",
        stages=("ingest", "resize"),
        runs="allowed",
    )
    retire_deleted: bool = setting(
        section="lake",
        default=False,
        description="Remove rows whose source file is gone",
        stages=("resize",),
        runs="refused",
        why="a policy that removes data",
    )
    manifest_roots: list[str] = setting(
        section="ingest",
        default_factory=list,
        description="Folders or URIs besides a manifest CSV's own folder whose files its rows may name",
        stages=("ingest",),
        runs="refused",
        why="folders a manifest's rows may read from: a run could read any file the worker can",
    )
    max_file_bytes: int = setting(
        section="ingest",
        default=50 * 1024 * 1024,
        ge=1,
        description="Larger files are quarantined",
        stages=("ingest", "resize"),
        runs="allowed",
        why=DECODER_GUARD,
        cap=("at most", 50 * 1024 * 1024),
    )
    read_attempts: int = setting(
        section="ingest",
        default=3,
        ge=1,
        description="Reads of a source file before it is left for the next run (a read error is never quarantined)",
        stages=("resize", "promote", "score"),
        runs="allowed",
    )
    requeue_reasons: list[str] = setting(
        section="ingest",
        default_factory=list,
        description=(
            "Quarantine reasons whose files every run sends back through (as `imagelake requeue --reason` does once)"
        ),
        # The requeue stage reads it; that stage runs every time (no stored result).
        stages=("requeue",),
        runs="allowed",
    )
    max_image_pixels: int = setting(
        section="ingest",
        default=64_000_000,
        ge=1,
        description="Larger images are quarantined as decompression bombs",
        stages=("resize", "promote"),
        runs="allowed",
        why=DECODER_GUARD,
        cap=("at most", 64_000_000),
    )
    max_decode_seconds: float = setting(
        section="ingest",
        default=30.0,
        gt=0,
        description=(
            "A file whose decoding goes on longer is quarantined as decode_timeout (checked as the decoder reads "
            "the file)"
        ),
        stages=("resize",),
        runs="allowed",
        why=DECODER_GUARD,
        cap=("at most", 30),
    )
    max_bad_fraction: float = setting(
        section="ingest",
        default=0.2,
        ge=0,
        le=1,
        description="A run with more bad files fails and writes nothing",
        # resize too: a write that refused took back the files the resize stage wrote.
        stages=("resize", "write"),
        runs="allowed",
    )
    max_retire_fraction: float = setting(
        section="ingest",
        default=0.5,
        ge=0,
        le=1,
        description="A run that would retire more of any date's rows fails and writes nothing",
        # resize too, as max_bad_fraction.
        stages=("resize", "write"),
        runs="allowed",
        why="a run that would retire more of a date's rows writes nothing: a run may only be more careful",
        cap=("at most", 0.5),
    )
    decode_in_driver_up_to: int = setting(
        section="ingest",
        default=1000,
        ge=0,
        description=(
            "A run with at most this many files to decode decodes them in the driver, without Spark's Python "
            "workers (0: always on the executors)"
        ),
        stages=(),
        runs="allowed",
    )
    quarantine_table_name: str = setting(
        section="lake",
        default="quarantine",
        description="Name of the table of bad files (path, reason) under table_root",
        stages=(),
        runs="refused",
        why=WHERE_DATA_LIVES,
    )
    vacuum_retention_hours: float = setting(
        section="lake",
        default=168,
        ge=0,
        description="Keep files of table versions this recent",
        stages=(),
        runs="allowed",
        why=(
            "vacuum deletes files no commit added yet (Delta's retention check off): below Delta's own week it "
            "deletes what time travel, readers and a writer still committing need"
        ),
        cap=("at least", 168),
    )

    val_fraction: float = setting(
        section="cache and loader",
        default=0.1,
        gt=0,
        lt=1,
        description="Share of images in the validation split (by hash)",
        stages=("split", "promote"),
        runs="allowed",
    )
    test_fraction: float = setting(
        section="cache and loader",
        default=0.1,
        gt=0,
        lt=1,
        description="Share of images in the test split (by hash)",
        stages=("split", "promote"),
        runs="allowed",
    )
    partitions_per_worker: int = setting(
        section="cache and loader",
        default=2,
        ge=2,
        description="Cache files of each split per training worker (each worker reads its own share)",
        stages=("split", "promote"),
        runs="allowed",
    )
    cache_root: str | None = setting(
        section="lake",
        default=None,
        description="Folder or URI of the Petastorm cache of the splits (default: workspace/cache)",
        stages=(),
        runs="refused",
        why=WHERE_DATA_LIVES,
    )
    cache_format: Literal["raw", "jpeg"] = setting(
        section="cache and loader",
        default="raw",
        description=(
            "How the cache holds each image: raw pixels (no decoding when training) or JPEG (several times fewer "
            "bytes, decoded when read)"
        ),
        stages=("cache",),
        runs="allowed",
    )
    cache_jpeg_quality: int = setting(
        section="cache and loader",
        default=95,
        ge=50,
        le=100,
        description="JPEG quality of a cache_format=jpeg cache (higher: closer, larger)",
        stages=("cache",),
        runs="allowed",
    )
    staging_root: str | None = setting(
        section="lake",
        default=None,
        description="Folder or URI for files handed between stages",
        stages=(),
        runs="refused",
        why=WHERE_DATA_LIVES,
    )

    ray_address: str | None = setting(
        section="servers",
        default=None,
        description="Ray cluster to join (host:port, ray://host:port or auto); none starts Ray here",
        stages=(),
        runs="refused",
        why=WHERE_IT_CONNECTS,
    )
    ray_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = setting(
        section="training",
        default="PACK",
        description="How Ray places training workers: PACK fills a node's GPUs first, SPREAD uses more machines",
        stages=(),
        runs="allowed",
    )
    ray_storage_root: str | None = setting(
        section="lake",
        default=None,
        description="Folder where Ray Train keeps checkpoints; shared by every node (default: workspace/ray_results)",
        stages=(),
        runs="refused",
        why=WHERE_DATA_LIVES,
    )
    num_workers: int = setting(
        section="training",
        default=2,
        ge=1,
        description="Ray Train workers",
        stages=("split", "train", "tune"),
        runs="allowed",
        why="each worker holds a loader, its buffers and a model: a run may not take a whole cluster",
        cap=("at most", 64),
    )
    use_gpu: bool = setting(
        section="training",
        default=False,
        description="Train on GPUs: one a worker (gpus_per_worker), bf16",
        stages=("train", "tune"),
        runs="allowed",
    )
    cpus_per_worker: float = setting(
        section="training",
        default=1,
        gt=0,
        description="CPUs Ray reserves for each training worker",
        stages=(),
        runs="allowed",
    )
    gpus_per_worker: float = setting(
        section="training",
        default=1,
        gt=0,
        description="With use_gpu",
        stages=(),
        runs="allowed",
        why="GPUs a run holds on the worker's cluster: a run may not take a whole node's",
        cap=("at most", 8),
    )
    max_failures: int = setting(
        section="training",
        default=1,
        ge=-1,
        description="Worker failures a training run survives (-1: no limit)",
        stages=(),
        runs="allowed",
    )
    ray_log_to_driver: bool = setting(
        section="training",
        default=False,
        description=(
            "Show Ray workers' own output on the console too (it is always in Ray's session logs); progress "
            "lines come from the driver"
        ),
        stages=(),
        runs="allowed",
    )
    model_arch: Literal[MODEL_ARCHS] = setting(  # type: ignore[valid-type]
        section="training",
        default="mobilenet_v2",
        description=(
            "Any torchvision classification model by name (mobilenet_v2, resnet50, efficientnet_b0, convnext_tiny, "
            "vit_b_16, ...), or small_cnn (a small CNN trained from scratch, for tests and tiny images)"
        ),
        stages=("train", "tune"),
        runs="allowed",
    )
    pretrained: str | None = setting(
        section="training",
        default="IMAGENET1K_V1",
        description=(
            "Weights to start from: a torchvision weights name (IMAGENET1K_V1, ResNet50_Weights.IMAGENET1K_V2), "
            "imagenet (the architecture's best torchvision weights), both from torchvision's cache in TORCH_HOME "
            "(`make install` puts MobileNetV2's IMAGENET1K_V1 there) or downloaded into it; the path or URI of a "
            "state dict; or none (from scratch)"
        ),
        stages=("train", "tune"),
        runs="allowed",
    )
    freeze_backbone: bool = setting(
        section="training",
        default=False,
        description="Train only the classification head (a linear probe of the pretrained features)",
        stages=("train", "tune"),
        runs="allowed",
    )
    backbone_lr_factor: float = setting(
        section="training",
        default=0.1,
        gt=0,
        le=1,
        description="With pretrained weights, the backbone's learning rate as a fraction of the new head's",
        stages=("train", "tune"),
        runs="allowed",
    )
    weight_decay: float = setting(
        section="training",
        default=0.01,
        ge=0,
        lt=1,
        description="AdamW's weight decay, of every trained layer (0.01: AdamW's own default)",
        stages=("train", "tune"),
        runs="allowed",
    )
    augment: Literal["none", "light", "standard"] = setting(
        section="training",
        default="light",
        description=(
            "Training images, drawn per image and epoch: light is a random crop of 60-100% of the area; standard "
            "a crop of 25-100% and colour jitter"
        ),
        stages=("train", "tune"),
        runs="allowed",
    )
    augment_flip: bool = setting(
        section="training",
        default=False,
        description=(
            "Also mirror half the training images (for photos; a mirrored digit, letter or sign is another glyph)"
        ),
        stages=("train", "tune"),
        runs="allowed",
    )
    label_smoothing: float = setting(
        section="training",
        default=0.1,
        ge=0,
        lt=1,
        description="Label smoothing of the training loss",
        stages=("train", "tune"),
        runs="allowed",
    )
    class_weights: Literal["none", "balanced"] = setting(
        section="training",
        default="none",
        description=(
            "balanced weighs each label's training loss by the inverse of its share of the train split (for "
            "imbalanced tables)"
        ),
        stages=("train", "tune"),
        runs="allowed",
    )
    warm_start: bool = setting(
        section="training",
        default=False,
        description=(
            "Start from the champion's weights when it was trained for the same labels (same order), image size, "
            "resize mode and model_arch; else from scratch"
        ),
        stages=("train", "tune"),
        runs="allowed",
    )
    max_epochs: int = setting(
        section="training",
        default=12,
        ge=1,
        description="Most epochs of one training run (early stopping on val_loss usually ends it sooner)",
        stages=("train", "tune"),
        runs="allowed",
    )
    max_train_minutes: float | None = setting(
        section="training",
        default=None,
        gt=0,
        description="Training stops after this long, at the end of an epoch, and keeps its best checkpoint",
        stages=("train", "tune"),
        runs="allowed",
    )
    batch_size: int = setting(
        section="training",
        default=32,
        ge=1,
        description="Per worker",
        stages=("train", "tune"),
        runs="allowed",
        why="a run's batch sizes every buffer of the node it trains on (pinned and shared memory, the shuffle buffer)",
        cap=("at most", 1024),
    )
    base_lr: float = setting(
        section="training",
        default=1e-3,
        gt=0,
        description="Learning rate of one worker; scaled with num_workers",
        stages=("train", "tune"),
        runs="allowed",
    )
    lr_scaling: Literal["linear", "sqrt", "none"] = setting(
        section="training",
        default="linear",
        description="How the learning rate grows with the workers",
        stages=("train", "tune"),
        runs="allowed",
    )
    early_stopping_patience: int | None = setting(
        section="training",
        default=None,
        ge=0,
        description="Epochs without a better val_loss before training stops (default: half of max_epochs, at least 3)",
        stages=("train", "tune"),
        runs="allowed",
    )
    early_stopping_min_delta: float = setting(
        section="training",
        default=0.0,
        ge=0,
        description="Smallest fall of val_loss that counts as better for early stopping",
        stages=("train", "tune"),
        runs="allowed",
    )
    early_stopping_threshold: float | None = setting(
        section="training",
        default=None,
        description="Stop once val_loss is below this",
        stages=("train", "tune"),
        runs="allowed",
    )
    compile: bool | None = setting(
        section="training",
        default=None,
        description=(
            "torch.compile the model for training steps; default: on a GPU, the faster of eager and compiled as "
            "measured for the model (tasks/rules/training.py: GPU_LIMITS; compiled for a model not measured), "
            "eager on CPU"
        ),
        stages=("train", "tune"),
        runs="allowed",
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = setting(
        section="training",
        default="default",
        description="torch.compile's mode when compiling (reduce-overhead adds CUDA graphs)",
        stages=("train", "tune"),
        runs="allowed",
    )
    loader_workers: int = setting(
        section="cache and loader",
        default=2,
        ge=1,
        description="Petastorm reader threads per training worker",
        stages=(),
        runs="allowed",
        why="each thread holds row groups in memory",
        cap=("at most", 16),
    )
    loader_processes: int | None = setting(
        section="cache and loader",
        default=None,
        ge=0,
        le=16,
        description=(
            "Processes that make each training worker's batches (frees the worker's interpreter for the GPU; "
            "more feed faster models); 0: in its threads; default: 1 with a GPU (0 where a JPEG cache is decoded on "
            "it), 0 on CPU"
        ),
        # Two or more processes make other batches than one, though the same for the same seed.
        stages=("train", "tune"),
        runs="allowed",
    )
    shuffle_buffer_batches: int = setting(
        section="cache and loader",
        default=4,
        ge=1,
        description="Rows shuffled across row groups, in batches",
        stages=("train", "tune"),
        runs="allowed",
        why="held in the training process's memory: batch_size rows of images each",
        cap=("at most", 64),
    )
    jpeg_decode: Literal["auto", "loader", "device"] = setting(
        section="cache and loader",
        default="auto",
        description=(
            "Where a cache_format=jpeg cache's images are decoded: in the loader, on CPU; or on the training device "
            "by torchvision, a batch at a time (nvJPEG on a GPU); auto: the device when training on a GPU"
        ),
        stages=("train", "tune"),
        runs="allowed",
    )
    bf16: bool = setting(
        section="training",
        default=True,
        description="bf16 autocast on GPU (ignored on CPU)",
        stages=("train", "tune"),
        runs="allowed",
    )
    channels_last: bool = setting(
        section="training",
        default=True,
        description="channels_last memory format on GPU (ignored on CPU)",
        stages=("train", "tune"),
        runs="allowed",
    )
    pin_memory: bool = setting(
        section="cache and loader",
        default=True,
        description="Pinned host batches on GPU (ignored on CPU)",
        stages=(),
        runs="allowed",
    )
    seed: int = setting(
        section="training",
        default=42,
        description="Seed of the cache's row order, the loader, augmentation and the model's weights",
        stages=("cache", "train", "tune"),
        runs="allowed",
    )

    mlflow_tracking_uri: str | None = setting(
        section="servers",
        default=None,
        description="MLflow tracking server or store (default: a SQLite file in the workspace)",
        stages=(),
        runs="refused",
        why=WHERE_IT_CONNECTS,
    )
    mlflow_registry_uri: str | None = setting(
        section="servers",
        default=None,
        description="MLflow model registry (default: the tracking URI)",
        stages=("promote",),
        runs="refused",
        why=WHERE_IT_CONNECTS,
    )
    mlflow_experiment: str = setting(
        section="registry",
        default="imagelake",
        description="MLflow experiment of the training runs",
        stages=("train", "tune"),
        where=True,
        runs="refused",
        why=WHOSE_MODEL,
    )
    mlflow_ui_url: str = setting(
        section="servers",
        default="http://127.0.0.1:5000",
        description="MLflow UI that Prefect artifacts link to",
        stages=(),
        runs="refused",
        why="the address every run's Prefect artifacts link to: a run could point readers elsewhere",
    )
    model_name: str = setting(
        section="registry",
        default="imagelake-classifier",
        description="Registered model the gate promotes versions of",
        stages=("promote",),
        runs="refused",
        why=WHOSE_MODEL,
    )
    user: str | None = setting(
        section="registry",
        default=None,
        description="Who the registry's history records as moving an alias (unset: the login name)",
        stages=(),
        runs="refused",
        why="who the registry's history says promoted a version: a run may not sign as someone else",
    )
    promotion_metric: Literal["accuracy", "macro_f1", "loss"] = setting(
        section="registry",
        default="accuracy",
        description="What the promotion gate compares",
        stages=("promote",),
        runs="allowed",
    )
    promotion_margin: float = setting(
        section="registry",
        default=0.0,
        ge=0,
        description="How much a candidate must beat the champion by on promotion_metric",
        stages=("promote",),
        runs="allowed",
    )
    min_margin_over_baseline: float | None = setting(
        section="registry",
        default=None,
        ge=-1,
        le=1,
        description=(
            "A candidate whose test accuracy is not this much above its run's plain baseline (logistic "
            "regression on 32 px thumbnails) stays challenger; unset: the margin is shown, not enforced"
        ),
        stages=("promote",),
        runs="allowed",
    )
    allow_pickle_models: bool = setting(
        section="registry",
        default=False,
        description="Load registered models stored by pickling (unsafe for untrusted sources)",
        stages=("promote",),
        runs="refused",
        why="a policy that loads pickles (code) from the registry",
    )
    history_table_name: str = setting(
        section="registry",
        default="registry_history",
        description="Delta table of every alias move",
        stages=(),
        runs="refused",
        why=WHERE_DATA_LIVES,
    )
    predictions_table_name: str = setting(
        section="serving",
        default="predictions",
        description="Delta table of what `imagelake score` answered, one row per image content and model version",
        stages=(),
        runs="refused",
        why=WHERE_DATA_LIVES,
    )
    score_top_k: int = setting(
        section="serving",
        default=3,
        ge=1,
        description="Labels with their probabilities that `imagelake score` keeps per image",
        stages=("score",),
        runs="allowed",
    )
    score_commit_images: int = setting(
        section="serving",
        default=50_000,
        ge=1,
        description=(
            "Images `imagelake score` answers between two commits of the predictions table: a run that fails keeps "
            "what it committed, and the next goes on from there"
        ),
        stages=(),  # how the work is cut, not what is answered: the same answers in more or fewer commits
        why="a run may cut less finely, not into thousands of tiny commits (each one a file in the table's log)",
        runs="allowed",
        cap=("at least", 1000),
    )

    prefect_api_url: str | None = setting(
        section="servers",
        default=None,
        description="Prefect API of the runs (default: Prefect's own setting, else a server per run)",
        stages=(),
        runs="refused",
        why=WHERE_IT_CONNECTS,
    )
    results_root: str | None = setting(
        section="lake",
        default=None,
        description="Folder or URI where stage results are stored for reuse (default: workspace/prefect-results)",
        stages=(),
        runs="refused",
        why=(
            "where the worker keeps its stored stage results, which are unpickled: a run pointed elsewhere would "
            "load someone else's pickles"
        ),
    )
    workspace_retention_hours: float = setting(
        section="lake",
        default=168,
        ge=0,
        description=(
            "After each run, remove staging files, stored stage results and training checkpoints unchanged for "
            "this long (keep it above the longest run)"
        ),
        stages=(),
        runs="allowed",
        why=(
            "clean-up after each run deletes staging files, stage results and checkpoints this old: a running "
            "run's among them"
        ),
        cap=("at least", 168),
    )

    flow_timeout_hours: float | None = setting(
        section="limits",
        default=24,
        gt=0,
        description=(
            "A flow run still going after this long fails TimedOut (a run may set at most 24: nightly runs go "
            "one at a time)"
        ),
        stages=(),
        runs="allowed",
        why=(
            "a run that may run for days holds every run queued behind it (the nightly deployment runs one at a "
            "time); its stages' limits and lock waits need no cap of their own, since the flow's ends them all"
        ),
        cap=("at most", 24),
    )
    stage_timeout_minutes: float | None = setting(
        section="limits",
        default=360,
        gt=0,
        description=(
            "Time limit of each stage without one of its own (split, summary, retention, requeue, maintain, scoring)"
        ),
        stages=(),
        runs="allowed",
    )
    ingest_timeout_minutes: float | None = setting(
        section="limits",
        default=240,
        gt=0,
        description="Time limit of the ingest stage (listing millions of source files)",
        stages=(),
        runs="allowed",
    )
    resize_timeout_minutes: float | None = setting(
        section="limits",
        default=480,
        gt=0,
        description="Time limit of the resize stage (decoding millions of images)",
        stages=(),
        runs="allowed",
    )
    write_timeout_minutes: float | None = setting(
        section="limits",
        default=180,
        gt=0,
        description="Time limit of the write stage (the Delta merge)",
        stages=(),
        runs="allowed",
    )
    cache_timeout_minutes: float | None = setting(
        section="limits",
        default=360,
        gt=0,
        description="Time limit of the cache stage, its wait for another run caching the same line included",
        stages=(),
        runs="allowed",
    )
    train_timeout_minutes: float | None = setting(
        section="limits",
        default=720,
        gt=0,
        description=(
            "Time limit of the train stage, its wait for another run training the same Ray run included (keep it "
            "above max_train_minutes)"
        ),
        stages=(),
        runs="allowed",
    )
    promote_timeout_minutes: float | None = setting(
        section="limits",
        default=60,
        gt=0,
        description="Time limit of the promote stage (test predictions, the gate)",
        stages=(),
        runs="allowed",
    )
    cache_lock_wait_minutes: float | None = setting(
        section="limits",
        default=180,
        gt=0,
        description=(
            "How long the cache stage waits for another run caching the same line before it fails naming that run"
        ),
        stages=(),
        runs="allowed",
    )
    train_lock_wait_minutes: float | None = setting(
        section="limits",
        default=360,
        gt=0,
        description=(
            "How long the train stage waits for another run training the same Ray run before it fails naming that run"
        ),
        stages=(),
        runs="allowed",
    )
    allow_from_runs: Annotated[list[str], NoDecode] = setting(
        section="limits",
        default_factory=list,
        description=(
            "Settings that runs started from a deployment may set although the run policy refuses them or caps "
            "their value, read from the worker's environment: IMAGELAKE_ALLOW_FROM_RUNS=ray_address,pretrained"
        ),
        stages=(),
        runs="refused",
        why="it opens the run policy itself",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        # pretrained_weights (a state dict's path) became pretrained, which also names torchvision's weights.
        if isinstance(data, dict) and "pretrained_weights" in data:
            if data.get("pretrained") is not None:
                raise ValueError("pretrained_weights is the old name of pretrained: set only pretrained")
            data = {**data, "pretrained": data["pretrained_weights"]}
            del data["pretrained_weights"]
        return data

    @field_validator("allow_from_runs", mode="before")
    @classmethod
    def _names_by_commas(cls, value: Any) -> Any:
        return [name.strip() for name in value.split(",") if name.strip()] if isinstance(value, str) else value

    @field_validator("pretrained", "spark_merge_min_rows", mode="before")
    @classmethod
    def _none_is_none(cls, value: Any) -> Any:
        # none (or nothing) means unset, as augment's and class_weights' none do: no weights (never a file named none),
        # no bound.
        return None if isinstance(value, str) and value.strip().lower() in ("", "none") else value

    @model_validator(mode="after")
    def _no_credentials_in_addresses(self) -> Settings:
        values = [(name, getattr(self, name)) for name in type(self).model_fields]
        values += [(f"spark_jars[{i}]", jar) for i, jar in enumerate(self.spark_jars)]
        values += [(f"spark_conf {key}", value) for key, value in self.spark_conf.items()]
        for name, value in values:
            if isinstance(value, str) and "://" in value and has_password(value):
                raise ValueError(
                    f"{name} holds a password: give addresses without credentials and put those in the environment "
                    "(MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN, "
                    "PREFECT_API_KEY or PREFECT_API_AUTH_STRING, "
                    "PGPASSWORD or ~/.pgpass for a PostgreSQL store, AWS_* or your object store's own variables)"
                )
        for key in self.spark_conf:
            if names_a_secret(key):
                raise ValueError(
                    f"spark_conf {key} would put a secret into settings: let Spark read it from the environment or a "
                    "credentials provider (e.g. spark.hadoop.fs.s3a.aws.credentials.provider) instead"
                )
        return self

    @model_validator(mode="after")
    def _check_fractions(self) -> Settings:
        if self.val_fraction + self.test_fraction >= 0.9:
            raise ValueError("val_fraction + test_fraction must leave at least 10% of the images for training")
        if self.start_date and self.end_date and self.start_date > self.end_date:
            raise ValueError(f"start_date {self.start_date} is after end_date {self.end_date}")
        return self

    @model_validator(mode="after")
    def _lock_waits_end_first(self) -> Settings:
        # A wait that outlasts its stage's limit would end as that limit, and the error would not name who holds the
        # lock.
        for stage in ("cache", "train"):
            wait, limit = getattr(self, f"{stage}_lock_wait_minutes"), getattr(self, f"{stage}_timeout_minutes")
            if limit is not None and (wait is None or wait >= limit):
                raise ValueError(
                    f"{stage}_lock_wait_minutes={'none' if wait is None else f'{wait:g}'} must be below "
                    f"{stage}_timeout_minutes={limit:g}: "
                    f"set both, the wait shorter (e.g. {stage}_lock_wait_minutes={limit / 2:g})"
                )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Explicit overrides beat the environment, which beats the config file.
        return init_settings, env_settings, _ConfigFileSource(settings_cls)

    def lock_wait_seconds(self, stage: str) -> float | None:
        """How long STAGE (cache or train) waits for another run holding its lock, in seconds (None: as long as it
        takes)."""
        minutes = getattr(self, f"{stage}_lock_wait_minutes")
        return None if minutes is None else minutes * 60

    @property
    def patience(self) -> int:
        """Early stopping's patience: set, or half the epochs (the learning rate decays over all of them)."""
        return (
            self.early_stopping_patience if self.early_stopping_patience is not None else max(3, self.max_epochs // 2)
        )

    # Derived locations: all under the workspace unless set.
    @property
    def workspace_dir(self) -> Path:
        return self.workspace.expanduser().resolve()

    @property
    def tables_root(self) -> str:
        """The folder or URI the Delta tables are in: table_root, else the workspace's tables/."""
        return (self.table_root or str(self.workspace_dir / "tables")).rstrip("/")

    @property
    @in_keys_of("resize", "write")
    def table_uri(self) -> str:
        return f"{self.tables_root}/{self.table_name}"

    @property
    @in_keys_of("resize", "write", "requeue")
    def quarantine_uri(self) -> str:
        return f"{self.tables_root}/{self.quarantine_table_name}"

    @property
    @in_keys_of("score")
    def predictions_uri(self) -> str:
        return f"{self.tables_root}/{self.predictions_table_name}"

    @property
    @in_keys_of("promote")
    def history_uri(self) -> str:
        return f"{self.tables_root}/{self.history_table_name}"

    @property
    @in_keys_of("cache")
    def cache_uri(self) -> str:
        return self.cache_root or str(self.workspace_dir / "cache")

    @property
    @in_keys_of("ingest", "resize")
    def staging_uri(self) -> str:
        """Where stages hand files to each other: must be reachable from every executor on a cluster."""
        return (self.staging_root or str(self.workspace_dir / "staging")).rstrip("/")

    @property
    @in_keys_of("train", "tune")
    def ray_storage_path(self) -> str:
        return (self.ray_storage_root or str(self.workspace_dir / "ray_results")).rstrip("/")

    @property
    @in_keys_of("train", "tune", "promote", "score")
    def tracking_uri(self) -> str:
        return self.mlflow_tracking_uri or f"sqlite:///{self.workspace_dir / 'mlflow.db'}"

    @property
    def artifact_location(self) -> str | None:
        """Local artifact folder for the embedded SQLite store; a tracking server chooses its own."""
        if self.mlflow_tracking_uri:
            return None
        return (self.workspace_dir / "mlartifacts").as_uri()

    @property
    def prefect_results_dir(self) -> Path:
        return self.workspace_dir / "prefect-results"

    @property
    def results_uri(self) -> str:
        """Where every stage's stored result and key record lives."""
        return (self.results_root or str(self.prefect_results_dir)).rstrip("/")


def stage_settings(stage: str) -> tuple[str, ...]:
    """The settings that change STAGE's output, for its `@stage(settings=...)`: every field that declares the stage
    (stages=...) and every derived location that does (@in_keys_of), in the order Settings declares them."""
    return stage_fields(Settings, stage)


def load_settings(config_file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Read settings now: overrides, then IMAGELAKE_* variables, then the config file, then defaults."""
    path = Path(config_file) if config_file else None
    token = _config_file.set(path)
    try:
        return Settings(**(overrides or {}))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in exc.errors()
        )
        source = f" (config file {path})" if path else ""
        raise SettingsError(
            f"invalid imagelake settings{source}: {problems}. "
            "Fix the IMAGELAKE_<NAME> variable, the config file entry or the --set option of that name."
        ) from None
    finally:
        _config_file.reset(token)
