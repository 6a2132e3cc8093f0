"""The ``sparkjet`` command: :mod:`~sparkjet.cli.main` (argument parsing, ``partition``,
``hash``), :mod:`~sparkjet.cli.demo` (the demo job), :mod:`~sparkjet.cli.snapshots`
(``snapshots`` and ``jobs``), :mod:`~sparkjet.cli.args` (argparse number types)."""
