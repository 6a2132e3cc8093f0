"""``python -m sparkjet``: the ``sparkjet`` command."""
from sparkjet.cli import main

raise SystemExit(main())
