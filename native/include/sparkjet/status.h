/* Status codes returned by every fallible sparkjet C function.
 *
 * C never raises: a function returns one of these and, where it helps, the
 * index of the offending item through an out-parameter. The Python bindings
 * map each code to an exception in one place. */
#ifndef SPARKJET_STATUS_H
#define SPARKJET_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum sj_status {
    SJ_OK = 0,
    SJ_EINVAL = 1,  /* an argument is outside its documented domain */
    SJ_EBOUNDS = 2, /* an offset or length points outside its buffer */
    SJ_ERANGE = 3,  /* a value does not fit the requested key type */
    SJ_ENOMEM = 4,  /* an allocation failed */
    SJ_ECORRUPT = 5, /* input bytes fail a structural or checksum check */
    /* The barrier aligner's outcomes (sparkjet/aligner.h). */
    SJ_EAGAIN = 6,   /* push: the channel is full; poll: nothing can be taken now */
    SJ_ETIMEOUT = 7, /* a wait reached its deadline */
    SJ_ECLOSED = 8,  /* closed by sj_aligner_close, or failed (sj_aligner_failure) */
    SJ_EBARRIER = 9, /* an unexpected barrier: see sj_aligner_failure */
    SJ_EENDED = 10   /* a push to a channel whose end was already pushed */
} sj_status;

/* A short, static, human-readable name of a status ("out of bounds", ...). */
const char *sj_status_message(sj_status status);

#ifdef __cplusplus
}
#endif
#endif
