# Status codes to exceptions: the one place (every include file raises through here).
from sparkjet.libsparkjet cimport *
from sparkjet.libsparkjet_aligner cimport SJ_ALIGNER_MAX_SNAPSHOT_ID

from sparkjet.errors import (
    AggregateOverflowError,
    AlignerClosedError,
    BarrierError,
    CorruptDataError,
    InvalidArgumentError,
    KeyRangeError,
    SnapshotCorruptError,
    aligner_channel_error,
    aligner_closed_error,
    aligner_ended_error,
    aligner_snapshot_id_error,
    aligner_timeout_error,
)

# The exception class of each status; SJ_EBOUNDS and SJ_ECORRUPT mean input bytes whose
# offsets or lengths do not hold together. The aligner's outcomes that are not errors
# (SJ_EAGAIN) never reach here.
cdef dict _STATUS_ERRORS = {
    SJ_EINVAL: InvalidArgumentError,
    SJ_EBOUNDS: CorruptDataError,
    SJ_ECORRUPT: CorruptDataError,
    SJ_ERANGE: KeyRangeError,
    SJ_ENOMEM: MemoryError,
    SJ_ETIMEOUT: TimeoutError,
    SJ_ECLOSED: AlignerClosedError,
    SJ_EBARRIER: BarrierError,
    SJ_EENDED: InvalidArgumentError,
}


cdef object status_error(sj_status status, str message, int64_t index=-1):
    """The exception for a status, with `message` (which should say what was wrong)."""
    kind = _STATUS_ERRORS.get(status, InvalidArgumentError)
    if kind is KeyRangeError or kind is CorruptDataError:
        return kind(message, index)
    return kind(message)


cdef int check_status(sj_status status, str context, int64_t index=-1, int32_t column=-1,
                      list names=None, str unit="index", bint arrow=False) except -1:
    """Raises the exception for a failed status: "context, column 'name': what at index i"
    (`unit` names what the index counts; `arrow`: the input was Arrow columns, so a bounds
    or corrupt status means malformed Arrow buffers)."""
    if status == SJ_OK:
        return 0
    where = context
    if column >= 0:
        where += f", column {names[column]!r}" if names and column < len(names) else f", column {column}"
    at = f" at {unit} {index}" if index >= 0 else ""
    message = f"{where}: {sj_status_message(status).decode()}{at}"
    if arrow and (status == SJ_EBOUNDS or status == SJ_ECORRUPT):
        message += " (malformed Arrow buffers)"
    raise status_error(status, message, index)


cdef int check_corrupt(sj_status status, str source, int64_t offset, str field) except -1:
    """Raises SnapshotCorruptError for a failed status while decoding stored bytes."""
    if status == SJ_OK:
        return 0
    if status == SJ_ENOMEM:
        raise MemoryError(f"{source}: out of memory decoding {field}")
    raise SnapshotCorruptError(source, offset, field)


cdef object aligner_status_error(sj_status status, int32_t channel, int32_t channels,
                                 object timeout, int64_t snapshot_id, object failure):
    """The exception for a failed status of the barrier aligner, whose messages need the
    queue's context: the channel, the timeout, the snapshot id, and the failure record
    (a BarrierError, or None) that made the aligner fail."""
    if status == SJ_ENOMEM:
        return MemoryError("cannot allocate the aligner's queues")
    if status == SJ_EINVAL:
        if not 0 <= channel < channels:
            return aligner_channel_error(channel, channels)
        return aligner_snapshot_id_error(snapshot_id, SJ_ALIGNER_MAX_SNAPSHOT_ID)
    if status == SJ_EENDED:
        return aligner_ended_error(channel)
    if status == SJ_ETIMEOUT:
        return aligner_timeout_error(channel, timeout)
    if status == SJ_EBARRIER and failure is not None:
        return failure
    return aligner_closed_error(failure)  # SJ_ECLOSED, and a barrier fault without a record
