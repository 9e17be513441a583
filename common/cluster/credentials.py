"""Credentials as clients present them in headers: API keys, the admin token, bearer tokens.

A credential sent twice is no credential (which of two values a proxy in front checked cannot be
known), the ``Bearer`` scheme is matched in any case (RFC 9110 §11.1), and a value is compared as
the bytes that came (aiohttp decodes headers with ``surrogateescape``: bytes that are not UTF-8
compare unequal to every key instead of failing to encode -- a 401, not a 400 in Python's words).
"""
from __future__ import annotations

from typing import Mapping


def header_values(headers: Mapping[str, str], name: str) -> list[str]:
    """Every value of header ``name`` (a plain mapping holds one at most)."""
    getall = getattr(headers, "getall", None)
    return list(getall(name, [])) if getall is not None else [v for v in [headers.get(name)] if v is not None]


def presented(headers: Mapping[str, str], name: str) -> str | None:
    """Header ``name``'s value; None where it is absent or given more than once."""
    values = header_values(headers, name)
    return values[0] if len(values) == 1 else None


def bearer_token(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` value, else ``""``."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def credential_bytes(value: str) -> bytes:
    """The bytes a header value came as (for digests and constant-time comparisons)."""
    return value.encode("utf-8", "surrogateescape")
