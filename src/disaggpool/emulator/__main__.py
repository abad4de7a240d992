"""``python -m disaggpool.emulator ...``: the emulator's command line (see `cli`)."""

from __future__ import annotations

import sys

from disaggpool.emulator.cli import main

if __name__ == "__main__":
    sys.exit(main())
