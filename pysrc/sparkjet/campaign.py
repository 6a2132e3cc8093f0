"""``python -m sparkjet.campaign``: the fault campaign of :mod:`sparkjet.testing.campaign`
(jobs whose members are killed with SIGKILL at random moments, checked against a
failure-free run) under a shorter name; with ``--nemesis KINDS --faults N``, the nemesis
campaign of :mod:`sparkjet.testing.nemesis_campaign`."""
from sparkjet.testing.campaign import main

if __name__ == "__main__":
    raise SystemExit(main())
