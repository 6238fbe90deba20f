"""Loading the native FFI libraries and calling their targets (filled in by the FFI issue)."""

from __future__ import annotations


def is_available(platform: str) -> bool:
    """Returns True when the native library for `platform` is built and registered."""
    del platform
    return False


def unavailable_reason(platform: str) -> str:
    """Says why the native library for `platform` cannot be used."""
    return f"no native library is built for {platform!r} in this version"
