"""What part of a grammar id names an engine: its library's version and the revision of maskd's
mapping of specs onto it (bumped when that mapping changes). Here, so that a server knows the
xgrammar engine's version without importing xgrammar (which imports torch: ~2 s at every start)
until a spec needs it (engines/fallback.py)."""
from __future__ import annotations

from importlib.metadata import version

XGRAMMAR_MAPPING_REVISION = 2


def xgrammar_engine_version() -> str:
    return f"{version('xgrammar')}+maskd.{XGRAMMAR_MAPPING_REVISION}"
