# cython: freethreading_compatible = True
"""sparkjet's native library: the whole C core of native/ behind one extension module.

Compiled once, so one hash-kernel selection (``select_kernel``) reaches every user of the
hash kernels, Merkle trees included, and one function maps every status code to an
exception (``check_status``, in _status.pxi). Each area of the core has its own include
file; each takes buffers through the buffer protocol (pyarrow Buffers, numpy arrays,
bytes) and checks their sizes before the GIL is released, so no Python caller handles a
raw address. The public Python API over this module is in sparkjet.hash, .partitioning,
.chunks, .keyed_state, .merkle, .aligner and ._groups; downstream Cython cimports the
nogil C API declared in _native.pxd (re-exported by hash.pxd and _merkle.pxd).
"""
include "_status.pxi"
include "_buffers.pxi"
include "_hash.pxi"
include "_chunk.pxi"
include "_blosc2.pxi"
include "_keyed.pxi"
include "_dedup.pxi"
include "_merkle.pxi"
include "_aligner.pxi"
include "_window.pxi"
