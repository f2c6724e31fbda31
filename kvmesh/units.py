"""Parsing of command-line quantities with units, shared by the services' flags."""

from __future__ import annotations

import argparse
import re

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """``67108864``, ``64MiB``, ``64M`` or ``1GiB`` as a number of bytes (binary units)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 268435456, 256MiB)")
    return int(m.group(1)) * _UNITS[(m.group(2) or "")[:1].upper()]
