"""The job runtime. On Spark (``Job.run(spark)``, :mod:`~sparkjet.runtime.spark_runner`) each
execution is a barrier stage whose tasks are members (:mod:`~sparkjet.runtime.member`) that
exchange batches and barriers over Arrow Flight (:mod:`~sparkjet.runtime.exchange`), and the
snapshot coordinator (:mod:`~sparkjet.runtime.coordinator`) runs on the driver, which restarts
failed executions from the last complete snapshot. Without Spark, one member runs in a child
process under a local supervisor."""
from sparkjet.runtime.config import JobConfig
from sparkjet.runtime.job import Job, JobFailedError, JobResult

__all__ = ["Job", "JobConfig", "JobFailedError", "JobResult"]
