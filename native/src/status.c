#include "sparkjet/status.h"

const char *sj_status_message(sj_status status) {
    switch (status) {
    case SJ_OK: return "ok";
    case SJ_EINVAL: return "invalid argument";
    case SJ_EBOUNDS: return "offset or length outside its buffer";
    case SJ_ERANGE: return "value out of range for the key type";
    case SJ_ENOMEM: return "out of memory";
    case SJ_ECORRUPT: return "corrupt input";
    case SJ_EAGAIN: return "would block";
    case SJ_ETIMEOUT: return "timed out";
    case SJ_ECLOSED: return "closed";
    case SJ_EBARRIER: return "unexpected barrier";
    case SJ_EENDED: return "channel already ended";
    }
    return "unknown status";
}
