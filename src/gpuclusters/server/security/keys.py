"""API keys: ``gpc_`` + 43 url-safe characters (256 bits). We store the
SHA-256 of the key and its first characters (to tell keys apart in lists);
the key itself is shown once, when issued."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "gpc_"


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str) -> str:
    return key[:10]
