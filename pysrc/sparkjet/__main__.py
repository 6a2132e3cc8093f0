"""``python -m sparkjet``: the ``sparkjet`` command."""
from sparkjet.cli.main import main

raise SystemExit(main())
