"""sparkjet's exceptions, all of them: one base class, each also a builtin kind users already
catch. Modules that raise one may name it too (``sparkjet.runtime.JobFailedError``), but it is
defined here."""
import enum
import errno


class SparkjetError(Exception):
    """Base class of every error sparkjet raises on purpose."""


class InvalidArgumentError(SparkjetError, ValueError):
    """An argument is outside its documented domain (a partition count of 0, ...)."""

    deterministic = True  # a replay repeats it (see sparkjet.runtime.failures)


class UnsupportedTypeError(SparkjetError, TypeError):
    """A value's type (an Arrow type, a Python type) has no Hazelcast mapping."""

    deterministic = True  # a replay repeats it (see sparkjet.runtime.failures)


class NullKeyError(SparkjetError, ValueError):
    """A key column holds a null; ``index`` is the first one (its row in the batch),
    ``column`` the key column and ``stage`` the stage keyed by it, where known."""

    deterministic = True

    def __init__(self, message: str, index: int, column: str | None = None,
                 stage: str | None = None):
        super().__init__(message)
        self.index = index
        self.column = column
        self.stage = stage

    def __reduce__(self):
        return type(self), (self.args[0], self.index, self.column, self.stage)


class KeyRangeError(SparkjetError, ValueError):
    """A key value does not fit the requested Hazelcast type; ``index`` is the first one."""

    deterministic = True

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


class AggregateOverflowError(InvalidArgumentError):
    """An exact integer aggregate left the type that holds it: a ``sum`` past int64 (with
    ``aggregate(..., overflow="fail")``, the default) or past decimal128(38, 0). The message
    names the stage, the column and the key; ``index`` is the input row that overflowed
    (-1 when not known), ``column`` and ``key`` (a dict of key columns to values, or None
    when not known) say where."""

    def __init__(self, message: str, index: int = -1, column: str | None = None,
                 key: dict | None = None):
        super().__init__(message)
        self.index = index
        self.column = column
        self.key = key


class CorruptDataError(SparkjetError, ValueError):
    """Input bytes fail a structural check: an Arrow offset outside its buffer, a bad
    length, a failed checksum. ``index`` names the offending item where known, else -1."""

    def __init__(self, message: str, index: int = -1):
        super().__init__(message)
        self.index = index


class BadRecordError(CorruptDataError):
    """A record a stage cannot take (its ``on_error`` is "fail"): one a source cannot
    decode, a key a keyed stage cannot key by, a row a sink refuses. ``stage`` names the
    stage (a vertex or sink name), ``column`` the column at fault (None: the whole record),
    ``position`` where the record came from (topic, partition and offset; file and line;
    stream and id) or its row in the batch. A replay meets the same record: deterministic."""

    deterministic = True

    def __init__(self, message: str, stage: str | None = None, column: str | None = None,
                 position: str | None = None):
        super().__init__(message)
        self.stage = stage
        self.column = column
        self.position = position

    def __reduce__(self):
        return type(self), (self.args[0], self.stage, self.column, self.position)


class SnapshotCorruptError(CorruptDataError):
    """A snapshot chunk or record failed a check: ``path`` is the file, ``offset`` the
    chunk's byte offset in it, ``field`` what did not match."""

    def __init__(self, path: str | None, offset: int, field: str, detail: str = ""):
        where = f"{path}: " if path else ""
        super().__init__(
            f"{where}corrupt snapshot data at offset {offset}: bad {field}"
            + (f" ({detail})" if detail else ""),
            offset,
        )
        self.path = path
        self.offset = offset
        self.field = field
        self.detail = detail

    def __reduce__(self):
        return (type(self), (self.path, self.offset, self.field, self.detail))


class ConnectorError(SparkjetError, ConnectionError):
    """A source or sink could not reach or use its external system (unreachable, refused
    credentials); the message names the connector and never holds a credential."""


class SourceChangedError(SparkjetError, RuntimeError):
    """A replayable source's input no longer holds what the job read, or where it stands:
    a Kafka partition whose log now ends before (or starts after) the job's offset, a file
    changed or deleted after it was read. Replaying from the snapshot would read other data
    than the job's state was built from, so the job fails instead of rewinding silently; a
    replay would find the same (``deterministic``)."""

    deterministic = True  # a replay repeats it (see sparkjet.runtime.failures)


class OffsetOutOfRangeError(SourceChangedError):
    """A Kafka partition no longer holds the job's position: ``expected`` is the offset the
    job reads next, ``found`` what the broker has (the offset a fetch returned, or the log's
    start or end; None when the partition itself is gone), ``reason`` says which. Raised
    under ``on_offset_reset="fail"`` (the default) of the Kafka source."""

    def __init__(self, topic: str, partition: int, expected: int, found: int | None,
                 reason: str):
        found_text = "no such partition" if found is None else f"offset {found}"
        super().__init__(
            f"Kafka source: topic {topic!r} partition {partition}: expected offset {expected}, "
            f"found {found_text}: {reason}. The job stops rather than read records twice or "
            f"skip them; KafkaSource(on_offset_reset='earliest' or 'latest') continues from "
            f"the partition's start or end instead")
        self.topic = topic
        self.partition = partition
        self.expected = expected
        self.found = found
        self.reason = reason

    def __reduce__(self):
        return (type(self), (self.topic, self.partition, self.expected, self.found,
                             self.reason))


class SnapshotNotFoundError(SparkjetError, LookupError):
    """No complete snapshot matches what was asked for."""


class SnapshotStoreLostError(SnapshotNotFoundError):
    """A job's snapshot log vanished while the job ran (its store deleted or replaced):
    nothing can be restored or fenced there any more, and a new execution id from it could
    repeat one a zombie still holds. A replay would find the same: deterministic."""

    deterministic = True


class SnapshotUnrestorableError(SparkjetError, ValueError):
    """The newest complete snapshot failed to verify, and no older one may be restored in
    its place: none verifies, or falling back would replay output a sink already committed
    (``replayed``: the sink transactions or acknowledged messages, one line each) past the
    older snapshot (``fallback``: its id, or None). ``unusable``: the snapshots (and log
    events) that failed, and why. A replay repeats it: the job fails at once."""

    deterministic = True

    def __init__(self, message: str, unusable: list[str], replayed: list[str],
                 fallback: int | None):
        super().__init__(message)
        self.unusable = list(unusable)
        self.replayed = list(replayed)
        self.fallback = fallback

    def __reduce__(self):
        return (type(self), (self.args[0], self.unusable, self.replayed, self.fallback))


class SnapshotIncompleteError(SparkjetError, ValueError):
    """A snapshot's data does not match its validation record (a missing or extra
    chunk, a wrong count, job or checksum): it is refused whole, never restored in part."""


class RecoveryRefusedError(SnapshotIncompleteError):
    """A persistence restart (``JobConfig.persistence`` on the members' storage) cannot
    restore what its ``cluster_data_recovery_policy`` allows from the slots present: the
    message names the snapshot, the missing partitions, the slots and hosts that held them,
    and what to do (bring them back, a partial policy, or ``Job.force_start()``). A replay
    over the same slots would find the same."""

    deterministic = True


class SnapshotMismatchError(SparkjetError, ValueError):
    """A snapshot was taken by a pipeline of another shape than the one restoring it."""


class IncompatibleSnapshotError(SnapshotMismatchError):
    """A snapshot's state does not fit the pipeline restoring it; ``differences`` lists
    every vertex, sink or state column that differs (:mod:`sparkjet.runtime.restore`)."""

    def __init__(self, message: str, differences: list[str]):
        super().__init__(message)
        self.differences = list(differences)

    def __reduce__(self):
        return type(self), (self.args[0], self.differences)


class InFlightRescaleError(SnapshotMismatchError):
    """An unaligned snapshot (``JobConfig.alignment_timeout``) holds items in flight of a
    keyed processor, and the restoring execution gives its vertex another parallelism or
    other input channels: the items have nowhere to go back to. A replay repeats it."""

    deterministic = True


class SchemaMismatchError(SparkjetError, ValueError):
    """A batch does not fit the schema its output was fixed at (its first batch): a column
    changed type, appeared or went missing, or two processors produced different schemas.
    Refused before anything of it is committed; a replay would repeat it."""

    deterministic = True


class FencedError(SparkjetError, RuntimeError):
    """A writer of an older execution tried to write or commit after a newer execution
    was registered (a zombie): refused, and nothing it wrote becomes visible."""


# ------------------------------------------------------------------ the barrier aligner


class BarrierFault(enum.IntEnum):
    """Why a barrier was refused: native/include/sparkjet/aligner.h's sj_barrier_fault
    (sparkjet._native checks at import that the values agree)."""

    UNEXPECTED_ID = 1  # no alignment in progress; the id is not the expected one
    OTHER_ID = 2  # snapshot `expected` is aligning; this barrier has another id
    SECOND = 3  # the channel already delivered barrier `expected` (at-least-once)
    TERMINAL = 4  # the terminal flag differs from the other channels' barriers


class BarrierError(SparkjetError, ValueError):
    """A barrier the alignment cannot accept: ``channel`` sent barrier ``snapshot_id``
    while ``expected`` was expected or aligning (``None``: any id). ``fault`` says which
    rule it broke (a :class:`BarrierFault`)."""

    def __init__(self, fault: int, channel: int, snapshot_id: int, terminal: bool,
                 expected: int | None):
        super().__init__(_fault_message(fault, channel, snapshot_id, terminal, expected))
        self.fault = fault
        self.channel = channel
        self.snapshot_id = snapshot_id
        self.terminal = terminal
        self.expected = expected

    def __reduce__(self):
        return (type(self), (self.fault, self.channel, self.snapshot_id, self.terminal,
                             self.expected))


class AlignerClosedError(SparkjetError, RuntimeError):
    """The aligner was closed, or failed on a :class:`BarrierError` (then ``failure``
    holds it, and it is also the ``__cause__``)."""

    def __init__(self, message: str, failure: BarrierError | None = None):
        super().__init__(message)
        self.failure = failure


def _fault_message(fault: int, channel: int, snapshot_id: int, terminal: bool,
                   expected: int | None) -> str:
    where = f"unexpected barrier on channel {channel}: snapshot {snapshot_id}"
    if fault == BarrierFault.UNEXPECTED_ID:
        return f"{where}, expected snapshot {expected}"
    if fault == BarrierFault.OTHER_ID:
        return f"{where} while snapshot {expected} is aligning"
    if fault == BarrierFault.SECOND:
        return (f"{where}, but the channel already delivered the barrier of snapshot "
                f"{expected}, which is still aligning")
    if fault == BarrierFault.TERMINAL:
        kind = "terminal" if terminal else "not terminal"
        return (f"barrier of snapshot {snapshot_id} on channel {channel} is {kind}, unlike "
                "the other channels' barriers of that snapshot")
    return f"{where} (fault {fault})"


# The aligner's errors, built the same way by the native aligner and its Python reference.

def aligner_closed_error(failure: BarrierError | None) -> AlignerClosedError:
    if failure is None:
        return AlignerClosedError("the aligner is closed")
    error = AlignerClosedError(f"the aligner failed: {failure}", failure)
    error.__cause__ = failure
    return error


def aligner_channel_error(channel: int, channels: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"channel {channel} out of range: the aligner has channels 0..{channels - 1}")


def aligner_ended_error(channel: int) -> InvalidArgumentError:
    return InvalidArgumentError(f"channel {channel} has ended: nothing can follow end()")


def aligner_snapshot_id_error(snapshot_id: int, max_id: int) -> InvalidArgumentError:
    return InvalidArgumentError(f"snapshot id {snapshot_id} out of range 0..{max_id}")


def aligner_timeout_error(channel: int, timeout: float) -> TimeoutError:
    return TimeoutError(f"channel {channel} stayed full for the {timeout} s timeout")


def check_aligner_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout >= 0:  # also refuses NaN
        raise InvalidArgumentError(f"timeout must be None or >= 0 seconds, not {timeout!r}")


# -- Jobs, executions and members (raised by sparkjet.runtime) -----------------------------------

class JobFailedError(SparkjetError, RuntimeError):
    """The job could not finish: its member kept failing past ``max_restarts``."""


class JobAlreadyRunningError(SparkjetError, RuntimeError):
    """Another run of the same job holds its snapshot store."""


class JobFinishedError(SparkjetError, RuntimeError):
    """The job already ran to its end against this snapshot store."""


class JobCancelledError(SparkjetError, RuntimeError):
    """The job was cancelled (:meth:`~sparkjet.runtime.Job.cancel`): its running execution
    ended without a snapshot; a new run resumes from the last complete one."""


class ExecutionFailedError(SparkjetError, RuntimeError):
    """An execution ended with a failure (a member failed, died or went silent, or a
    snapshot could not complete). The job restarts it if its policy allows. A member's
    failure carries its ``report`` (:func:`sparkjet.runtime.failures.report`), and with it
    whether a replay would repeat it (``deterministic``) or an outage caused it
    (``transient``: its kind, or None)."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report or {}
        self.deterministic = bool(self.report.get("deterministic"))
        self.transient = self.report.get("transient")


class MemberFailedError(SparkjetError, RuntimeError):
    """A processor of the member failed; the execution ends (the supervisor may restart)."""


# -- The links between members (sparkjet.runtime.exchange) ---------------------------------------

class ExchangeError(SparkjetError, ConnectionError):
    """Talking to a peer failed: unreachable, connection lost, stream broken or cancelled.
    ``peer`` is the peer's address (a Flight location, or ``ipv4:host:port`` for a
    server's inbound peer)."""

    def __init__(self, message: str, peer: str | None = None):
        super().__init__(message)
        self.peer = peer

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        return (type(self), (self.args[0], self.peer))


class ExchangeTimeoutError(ExchangeError, TimeoutError):
    """A peer did not answer, or granted no credit, within the timeout."""


class ExchangeFencedError(ExchangeError, FencedError):
    """The peer belongs to another execution and refused the stream or action (or this
    server refused a zombie's)."""


class ExchangeAuthError(ExchangeError, PermissionError):
    """The peer refused the call's credentials (no token, another execution's, a replayed
    or forged one): see :mod:`sparkjet.runtime.exchange.security`."""


class ExchangeRefusedError(ExchangeError):
    """The peer is alive and refused the request: no such processor, channel or action,
    an action handler that raised, a closed aligner, a server shutting down, or a broken
    protocol rule."""


# -- Placement, tables, logs and storage ---------------------------------------------------------

class PartitionTableError(SparkjetError, ValueError):
    """A partition table, its arguments or its serialized form is invalid or incompatible."""


class TableLoadError(SparkjetError, ValueError):
    """A reference table could not be loaded, or does not fit its join."""


class StorageError(SparkjetError, OSError):
    """The storage of a snapshot store or a sink refused an operation: ``operation`` (``"write"``,
    ``"create directory"``, ...) on ``path`` failed (a read-only or full filesystem, a file
    where a folder should be, refused permission, a lost connection). Still an ``OSError``
    (``errno`` is the cause's), so code that catches those still does.

    ``deterministic`` says whether a replay would repeat it, for the restart policy
    (:mod:`sparkjet.runtime.failures`): a read-only filesystem, refused permission, a file
    where a folder is expected or a name too long do (the job fails at once); a full disk or
    quota may clear (the store's cleanup frees space, an operator makes room), so it is
    retried as an outage, within ``max_restarts`` however often it repeats; an I/O error
    or an object store's error of no known kind is retried like a lost member, and a
    second failure the same way ends the job."""

    #: The errnos a replay repeats.
    REPEATED = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                          errno.EISDIR, errno.ENAMETOOLONG})

    def __init__(self, operation: str, path: str, code: int | None = None, reason: str = ""):
        super().__init__(code, f"cannot {operation} {path}: {reason}")
        self.operation = operation
        self.path = path
        self.reason = reason
        self.deterministic = code in self.REPEATED

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return (type(self), (self.operation, self.path, self.errno, self.reason))


class StorageSlotError(SparkjetError, RuntimeError):
    """A member's storage slot cannot be used as it is: a slot of another host in a
    ``storage_dir`` (which must be host-local), a ``MEMBER.json`` or a file of the slot that
    does not parse, a slot written after it was released. Names the path and what to do; a
    replay would find the same."""

    deterministic = True


class MerkleSyncError(SparkjetError, ValueError):
    """A Merkle resync of a slot's stale replica (:mod:`sparkjet.runtime.resync`) did not
    end in the holder's data: the rebuilt partition's entry count or root hash differs from
    the holder's (a holder whose rows and tree disagree, rows damaged on the way). Names the
    vertex, partition, file and holder slot; nothing of the file is kept. Copy the
    partition whole (the backup stream) or from another holder."""

    deterministic = True


class LogLockedError(SparkjetError, RuntimeError):
    """Another live writer holds the log: a log has one writer at a time."""


class ObjectStoreRaceWarning(RuntimeWarning):
    """A commit record is created on a store without a conditional create (see the module
    doc): two committers racing for one name there can both succeed."""


# -- Spark, and the throwaway servers of sparkjet.testing ----------------------------------------

class JavaNotFoundError(SparkjetError, RuntimeError):
    """No Java runtime of version 17 or newer was found (or ``JAVA_HOME`` names an unusable
    one); the message says where sparkjet looked and what to install."""


class StandaloneClusterError(SparkjetError, RuntimeError):
    """The cluster did not start (or a worker did not come back); the message holds the
    tail of the logs of the processes concerned."""


class ConnectServerError(SparkjetError, RuntimeError):
    """The Spark Connect server did not start; the message holds the tail of its log."""


class NamespacesUnavailableError(SparkjetError, RuntimeError):
    """Network namespaces, veth pairs or a bridge cannot be made here (not root, no
    ``ip``, a container without ``CAP_NET_ADMIN``); the message says which step failed and
    why, and is the reason tests give when they skip."""


class NemesisError(SparkjetError, RuntimeError):
    """A nemesis could not inject or undo its fault (a missing tool such as ``nft``,
    ``tc`` or libfaketime, a command that failed, a target that is gone); the message names
    the nemesis, the target and the command's own error."""
