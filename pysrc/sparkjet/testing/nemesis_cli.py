"""The command line of the nemesis campaigns: ``python -m sparkjet.campaign --nemesis KINDS
--faults N`` (the options :func:`add_arguments` adds to the kill campaign's parser,
:func:`main` runs them): the local kinds of :mod:`sparkjet.testing.nemesis_campaign` and
the partitions of :mod:`sparkjet.testing.partition_campaign`, interleaved
(:func:`~sparkjet.testing.nemesis_campaign.kind_of`). ``--log FILE`` keeps every round;
``--resume`` continues the run a log holds, over several sittings."""
from __future__ import annotations

import json
import signal
import sys
import tempfile
from pathlib import Path

from sparkjet.cli.args import positive_int
from sparkjet.errors import NemesisError
from sparkjet.testing import partition_campaign
from sparkjet.testing.nemesis_campaign import KINDS, per_kind, round_json, run, summary

__all__ = ["ALL", "add_arguments", "kinds_of", "main"]


#: The kinds ``--nemesis all`` runs: every local kind, and partitions where namespaces can be
#: made.
ALL = (*KINDS, "partition")


def add_arguments(parser) -> None:
    """The nemesis campaign's options of ``python -m sparkjet.campaign``."""
    group = parser.add_argument_group(
        "nemesis campaign", "jobs (exactly-once and at-least-once, into every sink) under "
        "every kind of nemesis, a report per kind "
        f"(kinds: {', '.join(ALL)}; see sparkjet.testing.nemesis_campaign)")
    group.add_argument("--nemesis", default=None, metavar="KINDS",
                       help="'all' or a comma-separated list of kinds: run the nemesis "
                            "campaign instead of the kill campaign")
    group.add_argument("--faults", type=positive_int, default=100,
                       help="faults in all for --nemesis (default 100)")
    group.add_argument("--faults-per-round", type=positive_int, default=4,
                       help="faults of one kind per job (default 4)")
    group.add_argument("--log", default=None, metavar="FILE",
                       help="append every round (its ROUND-JSON line, with the round's index, "
                            "the seed, the package version and git commit) to FILE")
    group.add_argument("--resume", action="store_true",
                       help="with --log: continue the run FILE holds (the same command: seed, "
                            "kinds, faults per round) from the round after its last; the "
                            "summary counts every round in FILE")


def kinds_of(text: str) -> tuple[str, ...]:
    if text == "all":
        return ALL
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in ALL]
    if bad or not kinds:
        raise SystemExit(f"--nemesis: unknown kind(s) {', '.join(bad) or text!r}; "
                         f"'all' or some of {', '.join(ALL)}")
    return kinds


def _servers_importable(progress) -> None:
    """The tests' server launchers (``helpers``) from ``./tests`` when run from a checkout."""
    import importlib.util

    if importlib.util.find_spec("helpers") is None and Path("tests/helpers").is_dir():
        sys.path.insert(0, str(Path("tests").resolve()))
        progress("servers: the launchers of ./tests/helpers")


def main(args) -> int:
    """``python -m sparkjet.campaign --nemesis KINDS --faults N``: prints a line per round,
    the per-kind table, and with ``--json`` one JSON line; exit status 1 when a round is
    invalid."""
    kinds = kinds_of(args.nemesis)
    progress = print
    # SIGTERM ends the run as Ctrl-C does: the servers it started are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    _servers_importable(progress)
    if args.resume and not args.log:
        raise SystemExit("--resume needs --log FILE: the log of the run to continue")
    partition = partition_campaign.Cluster() if "partition" in kinds else None
    with tempfile.TemporaryDirectory(prefix="sparkjet-nemesis-") as tmp:
        work = Path(args.dir or tmp)
        try:
            # the kinds in turn, a partition round interleaved after every few local rounds
            results = run(work, args.faults, kinds, args.seed, progress,
                          args.faults_per_round, partition=partition, log=args.log,
                          resume=args.resume)
        except NemesisError as e:
            raise SystemExit(str(e)) from None
        finally:
            if partition is not None:
                partition.close()
    print(summary(results))
    if args.json:
        print("NEMESIS-JSON " + json.dumps({
            "per_kind": per_kind(results),
            "rounds": [json.loads(round_json(r)[len("ROUND-JSON "):]) for r in results]}))
    return 1 if any(not r.valid for r in results) or not results else 0
