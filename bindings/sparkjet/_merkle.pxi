# Merkle forest kernels (native/include/sparkjet/merkle.h).
from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t

from sparkjet.libsparkjet_merkle cimport *

MIN_DEPTH = SJ_MERKLE_MIN_DEPTH
MAX_DEPTH = SJ_MERKLE_MAX_DEPTH
DEFAULT_DEPTH = SJ_MERKLE_DEFAULT_DEPTH
VALUE_FACTOR = SJ_MERKLE_VALUE_FACTOR
MERKLE_FORMAT_VERSION = SJ_MERKLE_FORMAT_VERSION
MERKLE_HEADER_SIZE = SJ_MERKLE_HEADER_SIZE
MODE_VALUE = SJ_MERKLE_VALUE_HASH
MODE_ENTRY = SJ_MERKLE_ENTRY_HASH


# The cimportable API (declared in _native.pxd, re-exported by _merkle.pxd).
cdef int64_t merkle_node_count(int32_t depth) noexcept nogil:
    return sj_merkle_node_count(depth)

cdef int32_t merkle_leaf_of_hash(int32_t key_hash, int32_t depth) noexcept nogil:
    return sj_merkle_leaf_of_hash(key_hash, depth)

cdef int32_t merkle_entry_hash(int32_t key_hash, int32_t value_hash) noexcept nogil:
    return sj_merkle_entry_hash(key_hash, value_hash)

cdef sj_status merkle_update(const sj_merkle_forest *f, const sj_merkle_batch *b, int32_t sign,
                             int64_t *err_index, int32_t *err_column) noexcept nogil:
    return sj_merkle_update(f, b, sign, err_index, err_column)

cdef sj_status merkle_refresh(const sj_merkle_forest *f) noexcept nogil:
    return sj_merkle_refresh(f)

cdef sj_status merkle_diff(const sj_merkle_forest *a, const sj_merkle_forest *b, int64_t *out,
                           int64_t capacity, int64_t *count, int64_t *compared) noexcept nogil:
    return sj_merkle_diff(a, b, out, capacity, count, compared)

cdef sj_status merkle_locate(const sj_column *keys, int32_t key_count, int32_t depth,
                             int32_t partition_count, int32_t *partitions, int32_t *leaves,
                             int64_t *err_index, int32_t *err_column) noexcept nogil:
    return sj_merkle_locate(keys, key_count, depth, partition_count, partitions, leaves,
                            err_index, err_column)

cdef sj_status merkle_leaf_set_init(sj_merkle_leaf_set *s, int32_t depth, int32_t partition_count,
                                    const int64_t *leaf_ids, int64_t id_count,
                                    int64_t *err_index) noexcept nogil:
    return sj_merkle_leaf_set_init(s, depth, partition_count, leaf_ids, id_count, err_index)

cdef void merkle_leaf_set_free(sj_merkle_leaf_set *s) noexcept nogil:
    sj_merkle_leaf_set_free(s)

cdef sj_status merkle_select(const sj_column *keys, int32_t key_count,
                             const sj_merkle_leaf_set *s, uint8_t *mask, int64_t *selected,
                             int64_t *err_index, int32_t *err_column) noexcept nogil:
    return sj_merkle_select(keys, key_count, s, mask, selected, err_index, err_column)

cdef sj_status merkle_write(const int32_t *tree, int32_t depth, int32_t partition,
                            int32_t partition_count, int32_t mode, uint8_t *out,
                            int64_t out_size) noexcept nogil:
    return sj_merkle_write(tree, depth, partition, partition_count, mode, out, out_size)

cdef sj_status merkle_read_header(const uint8_t *buf, int64_t len, sj_merkle_header *h,
                                  int64_t *err_offset, const char **bad_field) noexcept nogil:
    return sj_merkle_read_header(buf, len, h, err_offset, bad_field)

cdef sj_status merkle_read_tree(const uint8_t *buf, int64_t len, const sj_merkle_header *h,
                                int32_t *tree) noexcept nogil:
    return sj_merkle_read_tree(buf, len, h, tree)


cdef sj_merkle_forest _forest(tuple handle):
    cdef sj_merkle_forest f
    f.nodes = <int32_t *><uintptr_t>handle[0]
    f.dirty = <uint8_t *><uintptr_t>handle[1]
    f.depth = handle[2]
    f.partition_count = handle[3]
    return f


def node_count(int32_t depth):
    """2**depth - 1, or -1 for a depth outside 2..27."""
    return sj_merkle_node_count(depth)


def serialized_size(int32_t depth):
    """Bytes of one serialized tree of this depth, or -1 for a bad depth."""
    return sj_merkle_serialized_size(depth)


def leaf_of_hash(int32_t key_hash, int32_t depth):
    """The node order of the leaf a key hash lands in."""
    return sj_merkle_leaf_of_hash(key_hash, depth)


def entry_hash(int32_t key_hash, int32_t value_hash):
    """The hash entry mode sums for (key, value)."""
    return sj_merkle_entry_hash(key_hash, value_hash)


def update(tuple forest, list key_descs, uintptr_t key_hashes, list value_descs,
           uintptr_t value_hashes, int64_t rows, int32_t mode, int32_t sign, list names=None,
           int64_t index_base=0):
    """Adds (sign 1) or removes (sign -1) a batch of entries: columns or int32 hashes."""
    cdef sj_merkle_forest f = _forest(forest)
    cdef Columns keys = Columns(key_descs)
    cdef Columns values = Columns(value_descs)
    cdef sj_merkle_batch b
    b.keys = keys.cols
    b.key_count = keys.n
    b.key_hashes = <const int32_t *>key_hashes
    b.values = values.cols
    b.value_count = values.n
    b.value_hashes = <const int32_t *>value_hashes
    b.rows = rows
    b.mode = mode
    cdef int64_t err = -1
    cdef int32_t err_col = -1
    cdef sj_status st
    with nogil:
        st = sj_merkle_update(&f, &b, sign, &err, &err_col)
    check_status(st, "Merkle update", err + index_base if err >= 0 else -1, err_col, names, "row")


def refresh(tuple forest):
    """Recomputes the inner nodes of the dirty trees."""
    cdef sj_merkle_forest f = _forest(forest)
    cdef sj_status st
    with nogil:
        st = sj_merkle_refresh(&f)
    check_status(st, "Merkle refresh", -1, -1, None)


def diff(tuple a, tuple b, uintptr_t out, int64_t capacity, uintptr_t compared):
    """Writes up to `capacity` differing leaf ids to `out`; returns how many differ."""
    cdef sj_merkle_forest fa = _forest(a)
    cdef sj_merkle_forest fb = _forest(b)
    cdef int64_t count = 0
    cdef sj_status st
    with nogil:
        st = sj_merkle_diff(&fa, &fb, <int64_t *>out, capacity, &count, <int64_t *>compared)
    check_status(st, "Merkle diff", -1, -1, None)
    return count


def locate(list key_descs, int32_t depth, int32_t partition_count, uintptr_t partitions,
           uintptr_t leaves, list names=None, int64_t index_base=0):
    """Writes each row's partition and leaf node order (either address may be 0)."""
    cdef Columns keys = Columns(key_descs)
    cdef int64_t err = -1
    cdef int32_t err_col = -1
    cdef sj_status st
    with nogil:
        st = sj_merkle_locate(keys.cols, keys.n, depth, partition_count, <int32_t *>partitions,
                              <int32_t *>leaves, &err, &err_col)
    check_status(st, "Merkle locate", err + index_base if err >= 0 else -1, err_col, names, "row")


cdef class LeafSet:
    """A set of leaves (ids as diff writes them) as the native bitmaps, built once and
    used to select the rows of any number of batches."""
    cdef sj_merkle_leaf_set s

    def __cinit__(self, int32_t depth, int32_t partition_count, uintptr_t leaf_ids,
                  int64_t id_count):
        cdef int64_t err = -1
        cdef sj_status st
        with nogil:
            st = sj_merkle_leaf_set_init(&self.s, depth, partition_count,
                                         <const int64_t *>leaf_ids, id_count, &err)
        if st == SJ_EINVAL and err >= 0:
            raise InvalidArgumentError(
                f"leaf id at position {err} is outside a forest of {partition_count} trees "
                f"of depth {depth}")
        check_status(st, "Merkle leaf set", -1, -1, None)

    def __dealloc__(self):
        sj_merkle_leaf_set_free(&self.s)

    @property
    def count(self):
        return self.s.count


def select(list key_descs, LeafSet leaves, uintptr_t mask, list names=None,
           int64_t index_base=0):
    """Writes the bit-packed mask of the rows under the set's leaves; returns how many."""
    cdef Columns keys = Columns(key_descs)
    cdef int64_t err = -1
    cdef int64_t selected = 0
    cdef int32_t err_col = -1
    cdef sj_status st
    with nogil:
        st = sj_merkle_select(keys.cols, keys.n, &leaves.s, <uint8_t *>mask, &selected, &err,
                              &err_col)
    check_status(st, "Merkle select", err + index_base if err >= 0 else -1, err_col, names, "row")
    return selected


def write(uintptr_t tree, int32_t depth, int32_t partition, int32_t partition_count,
          int32_t mode, uintptr_t out, int64_t out_size):
    """Serializes one tree into out[0 .. serialized_size(depth))."""
    cdef sj_status st
    with nogil:
        st = sj_merkle_write(<const int32_t *>tree, depth, partition, partition_count, mode,
                             <uint8_t *>out, out_size)
    check_status(st, "Merkle tree write", -1, -1, None)


def read_header(const uint8_t[::1] buf, int64_t offset, str context="Merkle tree"):
    """Checks the record at buf[offset:]; returns (version, depth, mode, partition,
    partition_count, size). Raises CorruptDataError naming the field and its byte."""
    cdef sj_merkle_header h
    cdef int64_t err = -1
    cdef const char *field = NULL
    cdef int64_t n = buf.shape[0]
    if offset < 0 or offset > n:
        raise InvalidArgumentError(f"offset {offset} outside a buffer of {n} bytes")
    cdef const uint8_t *p = &buf[0] + offset if n else NULL
    cdef sj_status st
    with nogil:
        st = sj_merkle_read_header(p, n - offset, &h, &err, &field)
    if st == SJ_OK:
        return h.version, h.depth, h.mode, h.partition, h.partition_count, h.size
    name = field.decode() if field != NULL else "record"
    if st == SJ_EBOUNDS:
        raise CorruptDataError(
            f"{context}: truncated at byte {offset + err}, in the {name} "
            f"({n - offset} bytes where the record needs more)", offset + err)
    if st == SJ_ECORRUPT:
        raise CorruptDataError(f"{context}: bad {name} at byte {offset + err}", offset + err)
    check_status(st, context, -1, -1, None)


def read_tree(const uint8_t[::1] buf, int64_t offset, tuple header, uintptr_t tree):
    """Loads the leaves of a record read_header accepted into `tree` and computes its
    inner nodes."""
    cdef sj_merkle_header h
    h.version, h.depth, h.mode, h.partition, h.partition_count, h.size = header
    cdef int64_t n = buf.shape[0]
    if offset < 0 or offset > n:
        raise InvalidArgumentError(f"offset {offset} outside a buffer of {n} bytes")
    cdef const uint8_t *p = &buf[0] + offset if n else NULL
    cdef sj_status st
    with nogil:
        st = sj_merkle_read_tree(p, n - offset, &h, <int32_t *>tree)
    check_status(st, "Merkle tree read", -1, -1, None)
