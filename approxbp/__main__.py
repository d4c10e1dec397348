"""``python -m approxbp …`` is ``approxbp …``."""

from approxbp.fitting.cli import main

raise SystemExit(main())
