"""Credentials out of sight: URLs and messages with their passwords masked, for every
``repr``, error and log line that names an external system."""
from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"


def redact_url(url: str) -> str:
    """``url`` with the password of its user part (and any ``password=`` query value)
    masked: ``redis://user:s3cret@host/0`` -> ``redis://user:***@host/0``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}{':' + MASK if colon else ''}@{host}" if user else f"{MASK}@{host}"
    # secret_key / secret_access_key: object stores' query options (pyarrow.fs URIs).
    query = re.sub(r"(?i)(password|passwd|pwd|secret(?:_access)?(?:_key)?|token)=[^&]*",
                   rf"\1={MASK}", parts.query)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact(text: str, *secrets: str | None) -> str:
    """``text`` with every occurrence of the given secrets masked."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return text
