"""`python -m disaggpool` is the `disaggpool` command."""

from disaggpool.cli import main

raise SystemExit(main())
