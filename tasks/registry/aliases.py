"""Where a registered model's aliases point, with MLflow's client alone: what every run's summary reads, without the
model code (torch) of tasks/registry/loading.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient


class RegistryError(ValueError):
    """An unknown model, version or alias, or an operation the registry's state does not allow."""


def alias_version(client: MlflowClient, name: str, alias: str) -> str | None:
    """The version an alias points at, or None; unknown models are an error."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException as exc:
        if exc.error_code not in ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST"):
            raise  # a server that did not answer says nothing about the alias
        try:
            client.get_registered_model(name)
        except MlflowException as missing:
            if missing.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise RegistryError(f"no registered model named {name!r}") from exc
            raise
        return None
