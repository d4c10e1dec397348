"""``python -m approxbp …`` is ``approxbp …``."""

from approxbp.cli import main

raise SystemExit(main())
