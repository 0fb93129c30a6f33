"""Progress bars for the long-running tools (tqdm): on stderr, and only when stderr is a terminal,
so logs, pipes and CI output stay clean. ``say`` prints a line without tearing a bar."""
from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm


def bar(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it") -> Any:
    """A tqdm bar that is silent (and free) when stderr is not a terminal."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, leave=False,
                dynamic_ncols=True, mininterval=0.2)


def say(message: str) -> None:
    """Prints a line to stdout around any live bar."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()
