"""The job runtime. On Spark (``Job.run(spark)``, :mod:`~sparkjet.runtime.spark_runner`) each
execution is a barrier stage whose tasks are members (:mod:`~sparkjet.runtime.member`) that
exchange batches and barriers over Arrow Flight (:mod:`~sparkjet.runtime.exchange`), and the
snapshot coordinator (:mod:`~sparkjet.runtime.coordinator`) runs on the driver, which restarts
failed executions from the last complete snapshot. Without Spark, one member runs in a child
process under a local supervisor (:mod:`~sparkjet.runtime.local_runner`).

The modules, each depending only on those listed before it:

- :mod:`~sparkjet.runtime.config`: :class:`JobConfig`, how a job runs, as plain data.
- :mod:`~sparkjet.runtime.topology`: which member runs which processor and owns which
  Hazelcast partition.
- :mod:`~sparkjet.runtime.coordinator`: takes and commits snapshots for one execution.
- :mod:`~sparkjet.runtime.snapshotting`: what a processor writes into a snapshot at a
  barrier and reads back at restore.
- :mod:`~sparkjet.runtime.processors`: the processor threads: source processors and keyed
  processors (which run an operator).
- :mod:`~sparkjet.runtime.member`: runs one member's processors and wires them to the
  coordinator and to the other members.
- :mod:`~sparkjet.runtime.member_main`: the entry point of a member child process.
- :mod:`~sparkjet.runtime.supervision`: what both supervisors share: :class:`JobResult`,
  :class:`JobFailedError` and the restart policy.
- :mod:`~sparkjet.runtime.local_runner`: supervises one member in a child process.
- :mod:`~sparkjet.runtime.spark_runner`: supervises the members of a Spark barrier stage.
- :mod:`~sparkjet.runtime.job`: :class:`Job`, which picks a runner and runs the pipeline.

Beside them, the pieces they are made of: :mod:`~sparkjet.runtime.aligner` (barrier
alignment of a processor's input channels), :mod:`~sparkjet.runtime.watermarks`,
:mod:`~sparkjet.runtime.outbox` (a processor's output), :mod:`~sparkjet.runtime.schemas`
(each output's fixed schema), :mod:`~sparkjet.runtime.restore` (where a job starts from, and
whether the snapshot fits the pipeline), :mod:`~sparkjet.runtime.lifecycle`,
:mod:`~sparkjet.runtime.failures`, :mod:`~sparkjet.runtime.observability` and
:mod:`~sparkjet.runtime.progress`.

:mod:`~sparkjet.runtime.exchange` (Arrow Flight streams between members and to the
coordinator: its wire protocol, server and client, and the links' security) loads its
server and client only where members talk to each other; the driver uses its
:mod:`~sparkjet.runtime.exchange.security` to make each execution's credentials.
"""
from sparkjet.runtime.config import JobConfig
from sparkjet.runtime.job import Job, JobFailedError, JobHandle, JobResult
from sparkjet.runtime.lifecycle import JobAlreadyRunningError, JobCancelledError, JobFinishedError

__all__ = ["Job", "JobAlreadyRunningError", "JobCancelledError", "JobConfig", "JobFailedError",
           "JobFinishedError", "JobHandle", "JobResult"]
