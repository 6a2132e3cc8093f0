# Merkle forest kernels (native/include/sparkjet/merkle.h).
#
# A forest arrives as numpy arrays: `nodes`, the partition_count trees of 2**depth - 1
# int32 nodes one after another (C-contiguous), and `dirty`, one uint8 flag per tree
# (its length is the partition count). Outputs are typed memoryviews or writable buffers,
# serialized trees any buffer. Every length is checked against what the C function reads
# or writes before the GIL is released. The Python-level names (forest_*, tree_*,
# locate_keys, select_keys, ...) differ from the cimportable merkle_* functions on purpose.
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint8_t

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


cdef int _merkle_check_depth(int32_t depth, str what) except -1:
    if sj_merkle_node_count(depth) < 0:
        raise InvalidArgumentError(
            f"{what}: depth must be in {SJ_MERKLE_MIN_DEPTH}..{SJ_MERKLE_MAX_DEPTH}, not {depth}")
    return 0


cdef int _merkle_check_mode(int32_t mode, str what) except -1:
    if mode != SJ_MERKLE_VALUE_HASH and mode != SJ_MERKLE_ENTRY_HASH:
        raise InvalidArgumentError(
            f"{what}: mode must be MODE_VALUE ({<int>SJ_MERKLE_VALUE_HASH}) or MODE_ENTRY "
            f"({<int>SJ_MERKLE_ENTRY_HASH}), not {mode}")
    return 0


cdef int _merkle_check_partitions(int32_t partition_count, str what) except -1:
    if partition_count < 1:
        raise InvalidArgumentError(f"{what}: partition_count must be >= 1, not {partition_count}")
    return 0


cdef int _merkle_forest(sj_merkle_forest *f, const int32_t[::1] nodes, const uint8_t[::1] dirty,
                 int32_t depth, str what) except -1:
    """Fills f over the arrays of a forest after checking that they hold one tree of
    `depth` per dirty flag. The caller keeps the arrays' views for as long as f is used."""
    _merkle_check_depth(depth, what)
    cdef int64_t node_count = sj_merkle_node_count(depth)
    cdef int64_t trees = dirty.shape[0]
    if trees < 1 or trees > INT32_MAX:
        raise InvalidArgumentError(
            f"{what}: dirty holds {trees} flags; a forest has 1..2**31-1 trees, one flag each")
    if nodes.shape[0] != trees * node_count:
        raise InvalidArgumentError(
            f"{what}: nodes holds {nodes.shape[0]} values; {trees} trees of depth {depth} "
            f"have {trees * node_count}")
    f.depth = depth
    f.partition_count = <int32_t>trees
    f.nodes = <int32_t *>&nodes[0]
    f.dirty = <uint8_t *>&dirty[0]
    return 0


cdef int _merkle_check_exact(Py_ssize_t have, int64_t need, str what) except -1:
    if have != need:
        raise InvalidArgumentError(f"{what} holds {have} values where {need} are expected")
    return 0


cdef Columns _merkle_keys(list key_descs, list names, str what):
    """The key columns (at least one, all of one length)."""
    if not key_descs:
        raise InvalidArgumentError(f"{what}: needs at least one key column")
    return Columns(key_descs, names)


def tree_node_count(int32_t depth):
    """2**depth - 1, or -1 for a depth outside 2..27."""
    return sj_merkle_node_count(depth)


def tree_serialized_size(int32_t depth):
    """Bytes of one serialized tree of this depth, or -1 for a bad depth."""
    return sj_merkle_serialized_size(depth)


def tree_leaf_of_hash(int32_t key_hash, int32_t depth):
    """The node order of the leaf a key hash lands in, in a tree of `depth`."""
    _merkle_check_depth(depth, "leaf of hash")
    return sj_merkle_leaf_of_hash(key_hash, depth)


def tree_entry_hash(int32_t key_hash, int32_t value_hash):
    """The hash entry mode sums for (key, value)."""
    return sj_merkle_entry_hash(key_hash, value_hash)


def forest_update(int32_t[::1] nodes not None, uint8_t[::1] dirty not None, int32_t depth,
                  int32_t mode, int32_t sign, list key_descs not None,
                  const int32_t[::1] key_hashes, list value_descs not None,
                  const int32_t[::1] value_hashes, list names=None, int64_t index_base=0):
    """Adds (sign 1) or removes (sign -1) a batch of entries to the forest's leaves and
    flags the trees touched dirty. Keys are key column tuples or, with none, `key_hashes`
    (int32, one per row); values are value column tuples, or `value_hashes` (one per
    row), or neither (each key's hash is its value's). All or nothing. `names` names
    the key columns then the value columns, for messages; `index_base` is added to
    the row numbers in them."""
    if sign != 1 and sign != -1:
        raise InvalidArgumentError(f"Merkle update: sign must be 1 or -1, not {sign}")
    _merkle_check_mode(mode, "Merkle update")
    cdef sj_merkle_forest f
    _merkle_forest(&f, nodes, dirty, depth, "Merkle update")
    nk = len(key_descs)
    cdef Columns keys = Columns(key_descs, names[:nk] if names else None)
    cdef Columns values = Columns(value_descs, names[nk:] if names else None)
    cdef int64_t rows
    if keys.n:
        if key_hashes is not None:
            raise InvalidArgumentError("Merkle update: key columns or key hashes, not both")
        rows = keys.rows
    elif key_hashes is None:
        raise InvalidArgumentError("Merkle update: needs key columns or key hashes")
    else:
        rows = key_hashes.shape[0]
    if values.n:
        if value_hashes is not None:
            raise InvalidArgumentError("Merkle update: value columns or value hashes, not both")
        if values.rows != rows:
            raise InvalidArgumentError(
                f"Merkle update: value columns of {values.rows} rows for {rows} keys")
    elif value_hashes is not None:
        _merkle_check_exact(value_hashes.shape[0], rows, "Merkle update: value_hashes")
    cdef sj_merkle_batch b
    b.keys = keys.cols
    b.key_count = keys.n
    b.key_hashes = &key_hashes[0] if key_hashes is not None and rows else NULL
    b.values = values.cols
    b.value_count = values.n
    b.value_hashes = &value_hashes[0] if value_hashes is not None and rows else NULL
    b.rows = rows
    b.mode = mode
    cdef int64_t err = -1
    cdef int32_t err_col = -1
    cdef sj_status st
    with nogil:
        st = sj_merkle_update(&f, &b, sign, &err, &err_col)
    check_status(st, "Merkle update", err + index_base if err >= 0 else -1, err_col, names, "row", True)


def forest_refresh(int32_t[::1] nodes not None, uint8_t[::1] dirty not None, int32_t depth):
    """Recomputes the inner nodes of the dirty trees and clears their flags."""
    cdef sj_merkle_forest f
    _merkle_forest(&f, nodes, dirty, depth, "Merkle refresh")
    cdef sj_status st
    with nogil:
        st = sj_merkle_refresh(&f)
    check_status(st, "Merkle refresh", -1, -1, None)


cdef int _merkle_check_clean(const uint8_t[::1] dirty, str what) except -1:
    cdef Py_ssize_t i
    for i in range(dirty.shape[0]):
        if dirty[i]:
            raise InvalidArgumentError(
                f"{what}: tree {i} has stale inner nodes (refresh the forest first)")
    return 0


def forest_diff(const int32_t[::1] a_nodes not None, const uint8_t[::1] a_dirty not None,
                int32_t a_depth, const int32_t[::1] b_nodes not None,
                const uint8_t[::1] b_dirty not None, int32_t b_depth,
                int64_t[::1] out not None, int64_t[::1] compared=None):
    """The leaves where two refreshed forests of one partition count differ, on their
    common depth: writes the first len(out) leaf ids to `out` and returns how many
    differ (call again with a larger out when that is more). `compared`, when given,
    receives the node pairs compared on each of the min(depths) levels."""
    cdef sj_merkle_forest fa, fb
    _merkle_forest(&fa, a_nodes, a_dirty, a_depth, "Merkle diff, first forest")
    _merkle_forest(&fb, b_nodes, b_dirty, b_depth, "Merkle diff, second forest")
    if fa.partition_count != fb.partition_count:
        raise InvalidArgumentError(
            f"Merkle diff: forests of {fa.partition_count} and {fb.partition_count} trees")
    _merkle_check_clean(a_dirty, "Merkle diff, first forest")
    _merkle_check_clean(b_dirty, "Merkle diff, second forest")
    cdef int32_t depth = min(a_depth, b_depth)
    if compared is not None and compared.shape[0] < depth:
        raise InvalidArgumentError(
            f"Merkle diff: compared holds {compared.shape[0]} values, {depth} are needed")
    cdef int64_t capacity = out.shape[0]
    cdef int64_t *out_ptr = &out[0] if capacity else NULL
    cdef int64_t *compared_ptr = &compared[0] if compared is not None else NULL
    cdef int64_t count = 0
    cdef sj_status st
    with nogil:
        st = sj_merkle_diff(&fa, &fb, out_ptr, capacity, &count, compared_ptr)
    check_status(st, "Merkle diff", -1, -1, None)
    return count


def locate_keys(list key_descs not None, int32_t depth, int32_t partition_count,
                int32_t[::1] partitions, int32_t[::1] leaves, list names=None,
                int64_t index_base=0):
    """Writes each row's partition to `partitions` and the node order of its leaf in a
    tree of `depth` to `leaves`: either may be None, else it holds one value per row."""
    _merkle_check_depth(depth, "Merkle locate")
    _merkle_check_partitions(partition_count, "Merkle locate")
    cdef Columns keys = _merkle_keys(key_descs, names, "Merkle locate")
    if partitions is not None:
        _merkle_check_exact(partitions.shape[0], keys.rows, "Merkle locate: partitions")
    if leaves is not None:
        _merkle_check_exact(leaves.shape[0], keys.rows, "Merkle locate: leaves")
    if keys.rows == 0:
        return
    cdef int32_t *parts_ptr = &partitions[0] if partitions is not None else NULL
    cdef int32_t *leaves_ptr = &leaves[0] if leaves is not None else NULL
    cdef int64_t err = -1
    cdef int32_t err_col = -1
    cdef sj_status st
    with nogil:
        st = sj_merkle_locate(keys.cols, keys.n, depth, partition_count, parts_ptr, leaves_ptr,
                              &err, &err_col)
    check_status(st, "Merkle locate", err + index_base if err >= 0 else -1, err_col, names, "row", True)


cdef class LeafSet:
    """A set of leaves (ids as forest_diff writes them) of forests of `partition_count`
    trees of `depth`, as the native bitmaps: built once and used to select the rows of
    any number of batches."""
    cdef sj_merkle_leaf_set s

    def __cinit__(self, int32_t depth, int32_t partition_count,
                  const int64_t[::1] leaf_ids not None):
        _merkle_check_depth(depth, "Merkle leaf set")
        _merkle_check_partitions(partition_count, "Merkle leaf set")
        cdef int64_t n = leaf_ids.shape[0]
        cdef const int64_t *ids = &leaf_ids[0] if n else NULL
        cdef int64_t err = -1
        cdef sj_status st
        with nogil:
            st = sj_merkle_leaf_set_init(&self.s, depth, partition_count, ids, n, &err)
        if st == SJ_EINVAL and err >= 0:
            raise InvalidArgumentError(
                f"leaf id {leaf_ids[err]} at position {err} is outside a forest of "
                f"{partition_count} trees of depth {depth}")
        check_status(st, "Merkle leaf set", -1, -1, None)

    def __dealloc__(self):
        sj_merkle_leaf_set_free(&self.s)

    @property
    def count(self):
        """Distinct leaves in the set."""
        return self.s.count

    @property
    def depth(self):
        return self.s.depth

    @property
    def partition_count(self):
        return self.s.partition_count


def select_keys(list key_descs not None, LeafSet leaves not None, object mask,
                list names=None, int64_t index_base=0):
    """Writes the Arrow bit-packed mask of the rows whose key lies under a leaf of the
    set to `mask` (a writable buffer of at least ceil(rows / 8) bytes); returns how many
    rows are set."""
    cdef Columns keys = _merkle_keys(key_descs, names, "Merkle select")
    cdef Buf m = sized_buf(mask, (keys.rows + 7) // 8, "Merkle select mask", True)
    if keys.rows == 0:
        return 0
    cdef int64_t err = -1
    cdef int64_t selected = 0
    cdef int32_t err_col = -1
    cdef sj_status st
    with nogil:
        st = sj_merkle_select(keys.cols, keys.n, &leaves.s, <uint8_t *>m.ptr, &selected, &err,
                              &err_col)
    check_status(st, "Merkle select", err + index_base if err >= 0 else -1, err_col, names, "row", True)
    return selected


def write_tree(const int32_t[::1] tree not None, int32_t depth, int32_t partition,
               int32_t partition_count, int32_t mode, object out):
    """Serializes one tree (its 2**depth - 1 nodes) into the first
    tree_serialized_size(depth) bytes of `out`, a writable buffer."""
    _merkle_check_depth(depth, "Merkle tree write")
    _merkle_check_exact(tree.shape[0], sj_merkle_node_count(depth), "Merkle tree write: tree")
    _merkle_check_partitions(partition_count, "Merkle tree write")
    if partition < 0 or partition >= partition_count:
        raise InvalidArgumentError(
            f"Merkle tree write: partition {partition} is outside 0..{partition_count - 1}")
    _merkle_check_mode(mode, "Merkle tree write")
    cdef int64_t size = sj_merkle_serialized_size(depth)
    cdef Buf o = sized_buf(out, size, "Merkle tree write output", True)
    cdef sj_status st
    with nogil:
        st = sj_merkle_write(&tree[0], depth, partition, partition_count, mode,
                             <uint8_t *>o.ptr, size)
    check_status(st, "Merkle tree write", -1, -1, None)


cdef const uint8_t *_merkle_at(const uint8_t[::1] buf, int64_t offset) except? NULL:
    """buf + offset, offset in 0..len(buf); NULL for an empty buffer."""
    cdef int64_t n = buf.shape[0]
    if offset < 0 or offset > n:
        raise InvalidArgumentError(f"offset {offset} outside a buffer of {n} bytes")
    return &buf[0] + offset if n else NULL


def read_tree_header(const uint8_t[::1] buf not None, int64_t offset,
                     str context="Merkle tree"):
    """Checks the record at buf[offset:]; returns (version, depth, mode, partition,
    partition_count, size). Raises CorruptDataError naming the field and its byte."""
    cdef sj_merkle_header h
    cdef int64_t err = -1
    cdef const char *field = NULL
    cdef int64_t n = buf.shape[0]
    cdef const uint8_t *p = _merkle_at(buf, offset)
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


def read_tree(const uint8_t[::1] buf not None, int64_t offset, tuple header not None,
              int32_t[::1] tree not None):
    """Loads the leaves of the record at buf[offset:], which read_tree_header accepted
    and described as `header`, into `tree` (2**depth - 1 values) and computes its inner
    nodes."""
    if len(header) != 6:
        raise InvalidArgumentError(
            f"Merkle tree read: header must be read_tree_header's 6 values, not {header!r:.80}")
    cdef sj_merkle_header h
    h.version, h.depth, h.mode, h.partition, h.partition_count, h.size = header
    _merkle_check_depth(h.depth, "Merkle tree read")
    if h.size != sj_merkle_serialized_size(h.depth):
        raise InvalidArgumentError(
            f"Merkle tree read: a record of depth {h.depth} has "
            f"{sj_merkle_serialized_size(h.depth)} bytes, not {h.size}")
    _merkle_check_exact(tree.shape[0], sj_merkle_node_count(h.depth), "Merkle tree read: tree")
    cdef int64_t n = buf.shape[0]
    cdef const uint8_t *p = _merkle_at(buf, offset)
    if n - offset < h.size:
        raise CorruptDataError(
            f"Merkle tree read: truncated at byte {n}: the record at byte {offset} needs "
            f"{h.size} bytes", n)
    cdef sj_status st
    with nogil:
        st = sj_merkle_read_tree(p, n - offset, &h, &tree[0])
    check_status(st, "Merkle tree read", -1, -1, None)
