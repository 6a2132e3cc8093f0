# The public Cython API of sparkjet's Merkle forests: nogil functions that downstream
# extensions cimport (`from sparkjet._merkle cimport merkle_update`) without linking
# against anything. They live in the one native library, sparkjet._native (_native.pxd);
# this file keeps the name downstream code has always used. The types are in
# sparkjet.libsparkjet_merkle.
from sparkjet._native cimport (
    merkle_diff,
    merkle_entry_hash,
    merkle_leaf_of_hash,
    merkle_leaf_set_free,
    merkle_leaf_set_init,
    merkle_locate,
    merkle_node_count,
    merkle_read_header,
    merkle_read_tree,
    merkle_refresh,
    merkle_select,
    merkle_update,
    merkle_write,
)
