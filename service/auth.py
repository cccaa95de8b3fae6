"""The API key check shared by HTTP and gRPC: `Authorization: Bearer KEY`."""

from __future__ import annotations

import hmac


def bearer_key_matches(header: bytes, api_key: bytes) -> bool:
    """Whether an Authorization value carries `api_key` as a bearer token; the scheme is
    case-insensitive (RFC 7235: `bearer KEY` is as good as `Bearer KEY`), the key compared in
    constant time."""
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key)
