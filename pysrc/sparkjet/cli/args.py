"""Argument types for the command line tools' argparse options: numbers that may be written
with digit separators (``500,000`` or ``10_000_000``) and must be in range, each failing
with a message argparse prints after the option's name."""
from __future__ import annotations

import argparse
import math


def _parse(text: str, kind: type, what: str):
    try:
        return kind(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def positive_int(text: str) -> int:
    """An int >= 1."""
    value = _parse(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """An int >= 0."""
    value = _parse(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _parse(text, float, "a number")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number more than 0, got {text}")
    return value


def campaign_parser(prog: str, doc: str | None, kinds_help: str) -> argparse.ArgumentParser:
    """The options every slot campaign (storage, persistence) takes: ``--faults`` (default
    200), ``--seed``, ``--members`` (local[MEMBERS], default 3), ``--kinds`` (comma
    separated, described by ``kinds_help``) and ``--dir``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=positive_int, default=200,
                        help="faults in all (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--members", type=positive_int, default=3,
                        help="members (and slots) per job: local[MEMBERS] (default 3)")
    parser.add_argument("--kinds", default=None, help=f"comma-separated kinds {kinds_help}")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    return parser

