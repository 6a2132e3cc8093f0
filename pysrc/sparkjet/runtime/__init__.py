"""The job runtime: a member runs a pipeline's processors and its snapshot coordinator; a
supervisor restarts the member from the last complete snapshot when it dies."""
from sparkjet.runtime.config import JobConfig
from sparkjet.runtime.job import Job, JobFailedError, JobResult

__all__ = ["Job", "JobConfig", "JobFailedError", "JobResult"]
