"""Tools for testing sparkjet for real, kept out of the public API (the first three kill,
stop or cut off processes).

- :mod:`sparkjet.testing.campaign`: fault campaigns, jobs whose members are killed with
  SIGKILL at random moments, checked against a failure-free run
  (``python -m sparkjet.testing.campaign --help``).
- :mod:`sparkjet.testing.nemesis`: faults with their undo (partitions, bandwidth caps,
  pauses, full/read-only/removed disks, server outages, clock skew), for Jepsen-style tests.
- :mod:`sparkjet.testing.netns`: hosts as network namespaces on a bridge, for the partitions
  (``StandaloneCluster(network=...)`` runs each worker in one).
- :mod:`sparkjet.testing.standalone`: a throwaway Spark standalone cluster on this machine
  (a master and worker JVMs) whose workers can be killed and restarted.
- :mod:`sparkjet.testing.connect_server`: a throwaway Spark Connect server on this machine
  (the one in pyspark's jars), for jobs run from a Spark Connect session.
- :mod:`sparkjet.testing.nexmark_reference`: plain answers of the NEXMark queries over a
  table of bids, to check streaming results against.
"""
