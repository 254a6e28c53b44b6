"""What passes between stages: small, serialisable handles, never data.

Fields marked `exclude=True` say what a run happened to do (rows added, a cache reused, where
a staging copy sits), not what the data is: they stay out of the next stage's key.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class Listed(BaseModel):
    manifest_uri: str = Field(exclude=True)
    source_uri: str
    listed: int
    listing_fingerprint: str


class ListingDiff(BaseModel):
    manifest_uri: str = Field(exclude=True)
    source_uri: str
    listed: int
    unchanged: int
    candidates: int
    retired: int
    table_version_seen: int | None
    quarantine_version_seen: int | None = None
    basis: str = ""  # what the diff depended on besides the versions (tasks/data/changes.py:diff_basis)
    in_sync_folder: str = Field(default="", exclude=True)
    listing_uri: str = Field(default="", exclude=True)  # the whole listing the diff was of
    state_key: str = Field(
        default="", exclude=True
    )  # the diff's inputs but the listing (tasks/data/changes.py:state_key)
    content_fingerprint: str


class Resized(BaseModel):
    staging_uri: str
    table_uri: str  # where the run's uncommitted data files were written
    image_size: int
    decoded: int
    known: int
    retired: int
    quarantined: dict[str, int]
    examples: dict[str, str] = Field(default_factory=dict, exclude=True)
    unread: dict[str, int] = Field(
        default_factory=dict, exclude=True
    )  # reason -> files no read could get: the next run reads them
    read_retries: int = Field(default=0, exclude=True)  # reads that failed and were tried again
    content_fingerprint: str
    # What the diff read: a write that leaves the tables in step with it marks the next versions so (data/changes.py).
    basis: str = ""
    versions_seen: tuple[int | None, int | None] = (None, None)
    in_sync_folder: str = Field(default="", exclude=True)
    listing_uri: str = Field(default="", exclude=True)
    state_key: str = Field(default="", exclude=True)

    @property
    def bad(self) -> int:
        return sum(self.quarantined.values())

    @property
    def unread_files(self) -> int:
        return sum(self.unread.values())


def left_unread(result: Resized | Written) -> str | None:
    """Why a resize or write result is not reused: files it could not read, which the next run reads again."""
    unread = result.unread_files if isinstance(result, Resized) else result.unread
    return f"{unread} file(s) could not be read then; read again" if unread else None


class TableVersion(BaseModel):
    """One version of the images table, and the engine that reads it: what the training chain starts from."""

    table_uri: str
    version: int
    engine: str


class Written(TableVersion):
    """The table version a write made, and what it changed."""

    rows: int = Field(exclude=True)
    retired: int = Field(default=0, exclude=True)
    quarantined: int = Field(default=0, exclude=True)
    unread: int = Field(
        default=0, exclude=True
    )  # files the resize stage could not read: this version lacks them, the next run reads them


class SplitPlan(TableVersion):
    """A table version's splits: their sizes and labels, and the partitions the cache writes each into."""

    labels: list[str]
    counts: dict[str, int]
    num_partitions: int
    val_fraction: float
    test_fraction: float
    label_counts: dict[str, dict[str, int]] = {}  # split -> label -> images
    quarantined: dict[
        str, int
    ] = {}  # reason -> files in the quarantine table now (the cache stage re-keys, its files are reused)


class CachedSplits(BaseModel):
    table_uri: str
    table_version: int
    cache_dir: str
    key: str
    splits: dict[str, str]
    counts: dict[str, int]
    labels: list[str]
    image_size: int
    num_partitions: int
    reused: bool = Field(exclude=True)
    label_counts: dict[str, dict[str, int]] = {}
    quarantined: dict[str, int] = Field(default_factory=dict, exclude=True)
    image_format: Literal["raw", "jpeg"] = "raw"  # how the cached files hold each image (tasks/data/cache_files.py)


class Trained(BaseModel):
    checkpoint_path: str
    ray_run_path: str
    mlflow_run_id: str
    num_workers: int
    learning_rate: float
    run_name: str = ""
    epochs_run: int
    best_val_loss: float
    val_accuracy: float
    worker_nodes: list[str] = []  # the Ray node of each rank
    warm_started_from: str = "none"  # the champion version training started from, or "none" (from scratch)
    pretrained_weights: str = "none"  # the pretrained weights it started from (torchvision's name or a path), or "none"
    pretrained_sha256: str = ""  # the SHA-256 of those weights' file (torchvision's), "" for a path or none
    step_path: str = ""  # how the workers stepped the model (eager or a compiled mode) and why ("": not recorded)
    baseline_accuracy: float | None = (
        None  # test accuracy of the plain baseline on the same split (tasks/registry/baseline.py)
    )
    fit_seconds: float = Field(default=0.0, exclude=True)  # Lightning's fit on rank 0, Ray's start-up apart


class Searched(BaseModel):
    """A hyperparameter search over one cache: its trials and the best one's settings."""

    search_name: str  # Ray Tune's experiment, under ray_storage_path: a killed search resumes from it
    mlflow_run_id: str  # the search's parent run; each trial is a child run of it
    trials: list[dict[str, Any]]  # trial, settings, val_acc, epochs, seconds, ended, mlflow_run_id (rules/tuning.py)
    best_settings: dict[str, Any]  # the best trial's values of the searched settings ({} if no trial reported one)
    best_val_accuracy: float | None
    settings_file: str  # the training settings of the best trial, as a settings file (--config)
    seconds: float


class Promoted(BaseModel):
    model_name: str
    model_version: str
    alias: str
    champion_version: str
    test_accuracy: float
    baseline_accuracy: float | None = None  # the run's plain baseline on the same test split
    previous_champion_accuracy: float | None
    decision: str = ""
