# c-blosc2 called without the GIL: a restore decodes a run of a file's Blosc2 chunks in
# one call, and a snapshot compresses each chunk in one call into a buffer the caller
# gives (blosc2's Python compress2 holds the GIL, allocates a zeroed buffer and copies its
# result out of it). The library is the one the `blosc2` wheel ships beside its
# extension (sparkjet.snapshot.chunks finds it and checks it against blosc2's own output
# before using it); it is opened with dlopen, so nothing of blosc2 is needed to build
# sparkjet, and a blosc2 without it leaves the restore on blosc2's Python API.
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset
from posix.dlfcn cimport RTLD_LOCAL, RTLD_NOW, dlerror, dlopen, dlsym

# blosc2_dparams of c-blosc2 3.x (blosc2.h); 2.x has the same fields without `typesize`,
# which it then never reads. Passed by value, so a library with other fields would misread
# it: the caller opens only 2.x and 3.x, and checks the result against blosc2's own output.
# The library is never dlclose'd (a thread may be inside it when the last reference goes).
ctypedef struct _blosc2_dparams:
    int16_t nthreads
    void *schunk
    void *postfilter
    void *postparams
    int32_t typesize

# blosc2_cparams of c-blosc2 2.x and 3.x (blosc2.h), by value as well. Every field is set
# as blosc2's Python compress2 sets it for the parameters sparkjet uses, so the bytes are
# the same: the caller compares them with compress2's before using this (2.x names the
# tuner fields otherwise; they are a pointer and an int set to NULL and 0 either way).
ctypedef struct _blosc2_cparams:
    uint8_t compcode
    uint8_t compcode_meta
    uint8_t clevel
    int use_dict
    int32_t typesize
    int16_t nthreads
    int32_t blocksize
    int32_t splitmode
    void *schunk
    uint8_t filters[6]
    uint8_t filters_meta[6]
    void *prefilter
    void *preparams
    void *tuner_params
    int tuner_id
    uint8_t instr_codec        # a C bool
    void *codec_params
    void *filter_params[6]

ctypedef void (*_b2_init_fn)() noexcept nogil
ctypedef const char *(*_b2_version_fn)() noexcept nogil
ctypedef void *(*_b2_create_dctx_fn)(_blosc2_dparams) noexcept nogil
ctypedef void (*_b2_free_ctx_fn)(void *) noexcept nogil
ctypedef int (*_b2_decompress_ctx_fn)(void *, const void *, int32_t, void *, int32_t) noexcept nogil
ctypedef void *(*_b2_create_cctx_fn)(_blosc2_cparams) noexcept nogil
ctypedef int (*_b2_compress_ctx_fn)(void *, const void *, int32_t, void *, int32_t) noexcept nogil
ctypedef int (*_b2_cbuffer_sizes_fn)(const void *, int32_t *, int32_t *, int32_t *) noexcept nogil

# A Blosc2 chunk starts with its extended header: cbuffer_sizes reads that much.
cdef int32_t _BLOSC2_HEADER = 32
cdef int64_t _BLOSC2_MAX = 2147483647      # sizes are int32 in its API
# What compression may add to a chunk (BLOSC2_MAX_OVERHEAD: the extended header).
BLOSC2_MAX_OVERHEAD = _BLOSC2_HEADER
# The codec and filter codes of the parameters compress() takes (blosc2.h).
_BLOSC2_LZ4 = 1
_BLOSC2_SHUFFLE = 1
_BLOSC2_AUTO_SPLIT = 3


cdef void *_symbol(void *handle, const char *name, str path) except NULL:
    cdef void *found = dlsym(handle, name)
    if found == NULL:
        raise OSError(f"{path} has no {name.decode()}: not a c-blosc2 library")
    return found


cdef class Blosc2Library:
    """c-blosc2 loaded from the shared library at ``path`` (raises ``OSError`` when it does
    not load or lacks a function used here). ``version`` is the library's own."""
    cdef void *handle
    cdef _b2_create_dctx_fn create_dctx
    cdef _b2_free_ctx_fn free_ctx
    cdef _b2_decompress_ctx_fn decompress_ctx
    cdef _b2_cbuffer_sizes_fn cbuffer_sizes
    cdef _b2_create_cctx_fn create_cctx
    cdef _b2_compress_ctx_fn compress_ctx
    cdef readonly str path
    cdef readonly str version

    def __cinit__(self, str path):
        self.path = path
        self.handle = dlopen(path.encode(), RTLD_NOW | RTLD_LOCAL)
        if self.handle == NULL:
            error = dlerror()
            raise OSError(f"cannot load {path}: "
                          f"{error.decode(errors='replace') if error != NULL else 'dlopen failed'}")
        cdef _b2_init_fn init = <_b2_init_fn>_symbol(self.handle, b"blosc2_init", path)
        cdef _b2_version_fn version = <_b2_version_fn>_symbol(
            self.handle, b"blosc2_get_version_string", path)
        self.create_dctx = <_b2_create_dctx_fn>_symbol(self.handle, b"blosc2_create_dctx", path)
        self.free_ctx = <_b2_free_ctx_fn>_symbol(self.handle, b"blosc2_free_ctx", path)
        self.decompress_ctx = <_b2_decompress_ctx_fn>_symbol(
            self.handle, b"blosc2_decompress_ctx", path)
        self.cbuffer_sizes = <_b2_cbuffer_sizes_fn>_symbol(
            self.handle, b"blosc2_cbuffer_sizes", path)
        self.create_cctx = <_b2_create_cctx_fn>_symbol(self.handle, b"blosc2_create_cctx", path)
        self.compress_ctx = <_b2_compress_ctx_fn>_symbol(
            self.handle, b"blosc2_compress_ctx", path)
        init()
        self.version = version().decode(errors="replace")

    def __repr__(self):
        return f"Blosc2Library({self.path!r}, version={self.version!r})"

    def decompress_run(self, list sources, object out, const int64_t[::1] sizes):
        """Decompresses the Blosc2 chunks ``sources`` (buffers) back to back into ``out``,
        chunk *i* into the next ``sizes[i]`` bytes, on one thread and without the GIL.
        Returns -1 when every chunk did, else the index of the first that did not: its
        header names another size than ``sizes[i]`` or than the source holds, or
        decompression failed (nothing is read past a source or written past its share)."""
        cdef Py_ssize_t n = len(sources), i, held = 0
        check_len(sizes.shape[0], n, "sizes")
        cdef int64_t total = 0
        for i in range(n):
            if sizes[i] < 0 or sizes[i] > _BLOSC2_MAX:
                raise InvalidArgumentError(f"sizes[{i}] is {sizes[i]}: 0..2**31-1 bytes")
            total += sizes[i]
        cdef Buf o = sized_buf(out, total, "out", True)
        cdef Py_buffer *views = <Py_buffer *>calloc(n if n else 1, sizeof(Py_buffer))
        if views == NULL:
            raise MemoryError()
        cdef _blosc2_dparams params
        params.nthreads = 1
        params.schunk = NULL
        params.postfilter = NULL
        params.postparams = NULL
        params.typesize = 8
        cdef void *ctx = NULL
        cdef Py_ssize_t failed = -1
        cdef uint8_t *dst = <uint8_t *>o.ptr
        cdef int32_t nbytes, cbytes, blocksize
        cdef int got
        try:
            for i in range(n):
                PyObject_GetBuffer(sources[i], &views[i], PyBUF_SIMPLE)
                held += 1
            with nogil:
                ctx = self.create_dctx(params)
                if ctx == NULL:
                    failed = 0
                i = 0
                while ctx != NULL and i < n:
                    if (views[i].len < _BLOSC2_HEADER or views[i].len > _BLOSC2_MAX
                            or self.cbuffer_sizes(views[i].buf, &nbytes, &cbytes,
                                                  &blocksize) < 0
                            or nbytes != sizes[i] or cbytes != views[i].len):
                        failed = i
                        break
                    got = self.decompress_ctx(ctx, views[i].buf, <int32_t>views[i].len, dst,
                                              <int32_t>sizes[i])
                    if got != sizes[i]:
                        failed = i
                        break
                    dst += sizes[i]
                    i += 1
                if ctx != NULL:
                    self.free_ctx(ctx)
        finally:
            for i in range(held):
                PyBuffer_Release(&views[i])
            free(views)
        return failed

    def compress_run(self, list sources, object out, int64_t[::1] sizes, int clevel=1,
                     int typesize=8):
        """Compresses each of ``sources`` (buffers) as :meth:`compress` does, back to back
        into ``out`` (a writable buffer of at least the sources' bytes plus
        ``BLOSC2_MAX_OVERHEAD`` per source), on one thread and without the GIL: a
        snapshot's chunks of a file in one call instead of a call and a buffer each.
        ``sizes[i]`` gets chunk *i*'s size; returns the bytes written. Nothing is written
        past ``out``: the room is checked before any source is compressed."""
        cdef Py_ssize_t n = len(sources), i, held = 0
        check_len(sizes.shape[0], n, "sizes")
        if not 0 <= clevel <= 9 or not 1 <= typesize <= 255:
            raise InvalidArgumentError(f"clevel {clevel} (0..9) or typesize {typesize} "
                                       f"(1..255) out of range")
        cdef Py_buffer *views = <Py_buffer *>calloc(n if n else 1, sizeof(Py_buffer))
        if views == NULL:
            raise MemoryError()
        cdef _blosc2_cparams params
        memset(&params, 0, sizeof(params))
        params.compcode = _BLOSC2_LZ4
        params.clevel = <uint8_t>clevel
        params.typesize = typesize
        params.nthreads = 1
        params.splitmode = _BLOSC2_AUTO_SPLIT
        params.filters[5] = _BLOSC2_SHUFFLE
        cdef Buf o
        cdef int64_t need = 0, written = 0
        cdef void *ctx = NULL
        cdef Py_ssize_t failed = -1
        cdef int got = 0
        try:
            for i in range(n):
                PyObject_GetBuffer(sources[i], &views[i], PyBUF_SIMPLE)
                held += 1
                if views[i].len > _BLOSC2_MAX - _BLOSC2_HEADER:
                    raise InvalidArgumentError(
                        f"sources[{i}] holds {views[i].len} bytes: at most "
                        f"{_BLOSC2_MAX - _BLOSC2_HEADER} fit one Blosc2 chunk")
                need += views[i].len + _BLOSC2_HEADER
            o = sized_buf(out, need, "out", True)
            with nogil:
                for i in range(n):
                    # a context per chunk: one reused compresses later chunks otherwise
                    # than compress() (and blosc2's compress2) does, and a chunk must have
                    # the same bytes whichever call made it
                    ctx = self.create_cctx(params)
                    if ctx == NULL:
                        failed = i
                        break
                    got = self.compress_ctx(ctx, views[i].buf, <int32_t>views[i].len,
                                            <void *>(o.ptr + written),
                                            <int32_t>(views[i].len + _BLOSC2_HEADER))
                    self.free_ctx(ctx)
                    if got <= 0:
                        failed = i
                        break
                    sizes[i] = got
                    written += got
        finally:
            for i in range(held):
                PyBuffer_Release(&views[i])
            free(views)
        if ctx == NULL and failed >= 0:
            raise MemoryError("c-blosc2 could not make a compression context")
        if failed >= 0:
            raise RuntimeError(f"c-blosc2 failed to compress sources[{failed}] (code {got})")
        return written

    def compress(self, object source, object out, int clevel=1, int typesize=8):
        """Compresses ``source`` into ``out`` (a writable buffer of at least
        ``len(source) + BLOSC2_MAX_OVERHEAD`` bytes) as one Blosc2 chunk: lz4 at ``clevel``
        after a shuffle by ``typesize`` bytes, on one thread, without the GIL. Returns the
        chunk's size in ``out``."""
        cdef Buf s = Buf(source, False, "source")
        if s.size > _BLOSC2_MAX - _BLOSC2_HEADER:
            raise InvalidArgumentError(f"source holds {s.size} bytes: at most "
                                       f"{_BLOSC2_MAX - _BLOSC2_HEADER} fit one Blosc2 chunk")
        if not 0 <= clevel <= 9 or not 1 <= typesize <= 255:
            raise InvalidArgumentError(f"clevel {clevel} (0..9) or typesize {typesize} "
                                       f"(1..255) out of range")
        cdef Buf o = sized_buf(out, s.size + _BLOSC2_HEADER, "out", True)
        cdef _blosc2_cparams params
        memset(&params, 0, sizeof(params))
        params.compcode = _BLOSC2_LZ4
        params.clevel = <uint8_t>clevel
        params.typesize = typesize
        params.nthreads = 1
        params.splitmode = _BLOSC2_AUTO_SPLIT
        params.filters[5] = _BLOSC2_SHUFFLE
        cdef void *ctx
        cdef int got = -1
        cdef int32_t capacity = <int32_t>(s.size + _BLOSC2_HEADER)
        with nogil:
            ctx = self.create_cctx(params)
            if ctx != NULL:
                got = self.compress_ctx(ctx, s.ptr, <int32_t>s.size, <void *>o.ptr, capacity)
                self.free_ctx(ctx)
        if ctx == NULL:
            raise MemoryError("c-blosc2 could not make a compression context")
        if got <= 0:
            raise RuntimeError(f"c-blosc2 failed to compress {s.size} bytes (code {got})")
        return got
