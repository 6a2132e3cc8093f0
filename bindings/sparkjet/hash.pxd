# The public Cython API of sparkjet's hashing: nogil functions that downstream
# extensions cimport (`from sparkjet.hash cimport partition_column`) without linking
# against anything. They live in the one native library, sparkjet._native (_native.pxd);
# this file keeps the name downstream code has always used.
from sparkjet._native cimport (
    Columns,
    hash_column,
    hash_rows,
    murmur3_32,
    partition_column,
    partition_of_hash,
)
