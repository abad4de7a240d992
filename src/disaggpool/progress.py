"""Progress bars for the commands and benches: drawn on a terminal, never into a log.

A tqdm bar redraws its line with carriage returns and cursor escapes. Written to a file (stderr
redirected, a Kubernetes Job's log, a CI log) it leaves hundreds of partial lines between the
messages, so every bar in the project is made here, disabled unless the stream it writes to is
a terminal (what tqdm's `disable=None` does, said once). The command line (`cli`), `loadgen`,
`demo` and the benches call `bar`.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm import tqdm

__all__ = ["bar", "drawn"]


def drawn(file: IO[str] | None = None) -> bool:
    """Whether a bar on `file` (default stderr) is drawn: only on a terminal."""
    stream = sys.stderr if file is None else file
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def bar(iterable: Any = None, /, **kwargs: Any) -> tqdm[Any]:
    """`tqdm(iterable, **kwargs)` on stderr, disabled unless stderr (or `file=`) is a terminal.

    On a disabled bar `update`, `refresh` and `close` do nothing, and wrapping an iterable it
    still yields every item: callers need not tell the two cases apart.
    """
    kwargs.setdefault("file", sys.stderr)
    kwargs["disable"] = not drawn(kwargs["file"])
    return tqdm(iterable, **kwargs)
