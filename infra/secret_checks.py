"""What Settings refuses to hold because it is a secret: a password in an address, a credential among Spark's
properties. Secrets belong in the environment (or a credentials provider), never in a settings file or a run's
parameters, which are stored and shown. Pure: the standard library only."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

_SECRET_KEY = re.compile(
    r"secret|password|passwd|token|account\.key|access\.key|(^|\.)sas(\.|$)|credential", re.IGNORECASE
)
# Keys that name where a secret comes from, not the secret itself (a provider class, a file, a path).
_SECRET_SOURCE = re.compile(r"(provider|file|path|type|class|endpoint|url|uri)$", re.IGNORECASE)


def has_password(uri: str) -> bool:
    """Whether an address (scheme://user:password@host...) carries a password."""
    try:
        return bool(urlsplit(uri).password)
    except ValueError:  # a malformed port: not ours to judge here
        return False


def names_a_secret(key: str) -> bool:
    """Whether a Spark property is a credential itself (fs.s3a.secret.key, fs.azure.account.key.*, ...)."""
    return bool(_SECRET_KEY.search(key)) and not _SECRET_SOURCE.search(key)
