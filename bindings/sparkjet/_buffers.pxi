# Buffers from Python objects: the binding's only way to reach memory.
from cpython.buffer cimport (
    PyBUF_ANY_CONTIGUOUS,
    PyBUF_SIMPLE,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)


cdef class Buf:
    """A contiguous buffer of any object with the buffer protocol (a pyarrow Buffer, a
    numpy array, bytes, bytearray, memoryview), held for as long as this object lives.
    `size` is in bytes, whatever the item type: kernels check it against what they read."""
    cdef Py_buffer view
    cdef bint held
    cdef const uint8_t *ptr
    cdef int64_t size

    def __cinit__(self, object obj, bint writable=False, str what="buffer"):
        cdef int flags = PyBUF_ANY_CONTIGUOUS | (PyBUF_WRITABLE if writable else PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(obj, &self.view, flags)
        except (TypeError, BufferError) as e:
            need = ("a writable contiguous buffer (numpy array, bytearray)" if writable else
                    "a contiguous buffer (pyarrow Buffer, numpy array, bytes)")
            raise TypeError(f"{what} must be {need}, "
                            f"not {type(obj).__name__}: {e}") from None
        self.held = True
        self.ptr = <const uint8_t *>self.view.buf
        self.size = self.view.len

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)

    def __len__(self):
        return self.size


cdef inline Buf buf_of(object obj, str what):
    """A read-only view of obj, or None for None (an absent Arrow buffer)."""
    if obj is None:
        return None
    return Buf(obj, False, what)


cdef Buf sized_buf(object obj, int64_t need, str what, bint writable=False):
    """A view of obj (writable if asked) holding at least `need` bytes."""
    cdef Buf b = Buf(obj, writable, what)
    if b.size < need:
        raise InvalidArgumentError(f"{what} holds {b.size} bytes, {need} are needed")
    return b


cdef int check_len(Py_ssize_t have, int64_t need, str what) except -1:
    """Refuses an array of `have` items where `need` are written or read. Every include
    file checks through here (they share one module namespace, so helpers of their own
    would need unique names)."""
    if have < need:
        raise InvalidArgumentError(f"{what} holds {have} values, {need} are needed")
    return 0
