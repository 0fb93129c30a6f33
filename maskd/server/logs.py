"""Logging for maskd processes: one format, the level from a flag or MASKD_LOG_LEVEL."""
from __future__ import annotations

import logging
import os

from maskd.server.config import LOG_LEVELS

LOG_LEVEL_ENV = "MASKD_LOG_LEVEL"
DEFAULT_LEVEL = "warning"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def resolve_level(level: str | None = None) -> str:
    """The level to use: the argument, else $MASKD_LOG_LEVEL, else warning."""
    chosen = (level or os.environ.get(LOG_LEVEL_ENV) or DEFAULT_LEVEL).strip().lower()
    if chosen not in LOG_LEVELS:
        raise ValueError(f"unknown log level {chosen!r}; use one of {', '.join(LOG_LEVELS)}"
                         + ("" if level else f" (from ${LOG_LEVEL_ENV})"))
    return chosen


def configure(level: str | None = None) -> str:
    """Sets up the root logger once per process (again with a new level); returns the level."""
    chosen = resolve_level(level)
    logging.basicConfig(level=chosen.upper(), format=FORMAT, force=True)
    return chosen
