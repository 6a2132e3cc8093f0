"""sparkjet's exceptions: one base class, each also a builtin kind users already catch."""


class SparkjetError(Exception):
    """Base class of every error sparkjet raises on purpose."""


class InvalidArgumentError(SparkjetError, ValueError):
    """An argument is outside its documented domain (a partition count of 0, ...)."""


class UnsupportedTypeError(SparkjetError, TypeError):
    """A value's type (an Arrow type, a Python type) has no Hazelcast mapping."""


class NullKeyError(SparkjetError, ValueError):
    """A key column holds a null; ``index`` is the first one."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


class KeyRangeError(SparkjetError, ValueError):
    """A key value does not fit the requested Hazelcast type; ``index`` is the first one."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


class CorruptDataError(SparkjetError, ValueError):
    """Input bytes fail a structural check: an Arrow offset outside its buffer, a bad
    length, a failed checksum. ``index`` names the offending item where known, else -1."""

    def __init__(self, message: str, index: int = -1):
        super().__init__(message)
        self.index = index


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

    def __reduce__(self):
        return (type(self), (self.path, self.offset, self.field))


class SnapshotNotFoundError(SparkjetError, LookupError):
    """No complete snapshot matches what was asked for."""


class SnapshotIncompleteError(SparkjetError, ValueError):
    """A snapshot's data does not match its validation record (a missing or extra
    chunk, a wrong count, job or checksum): it is refused whole, never restored in part."""


class FencedError(SparkjetError, RuntimeError):
    """A writer of an older execution tried to write or commit after a newer execution
    was registered (a zombie): refused, and nothing it wrote becomes visible."""
