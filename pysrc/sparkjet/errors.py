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
