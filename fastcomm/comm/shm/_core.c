/* Compiled core of the shm communicator: the small collectives and the reductions.
 *
 * Python sequences the shm protocol (flags.py, schedules.py); at a few KiB its own per-call
 * cost (a dozen attribute loads, word reads through a memoryview, a NumPy or torch call per
 * step) is the whole time of a collective. This module runs the same protocol, on the same
 * words, in C, for a collective that fits one slot (one round): wait until the half is free,
 * record the call's descriptor, copy in, publish, wait for every peer, check their descriptors,
 * then copy out or reduce in rank order. Every wait here only spins for a bounded time; when a
 * peer is not there yet it returns a status and Python finishes the wait (yield, futex sleep,
 * timeouts, liveness, aborts) with its own code, then calls back to resume. Ranks with and
 * without this module interoperate: the words, the slots and their order are the same.
 *
 * The round of every collective (schedules.py, "Rounds"): stage 0 waits until every peer's seq
 * reached `enter`; stage 1 stores descriptor words A (`code_a`) and B of this half, copies in and
 * publishes `target`; stage 2 waits until every peer's seq reached `target`, compares every
 * peer's A and B of this half with this rank's (MISMATCH: nothing copied out or reduced) and
 * finishes. B is computed here: the root + 1 of a reduce (0 for an all-reduce), the source + 1
 * of a broadcast, 0 otherwise (a small round has fewer than 2**40 elements).
 *
 * Send/recv of a message chunk that fits one mailbox slot (schedules.py, "Point to point"):
 * chunk k of the ordered pair (s, d) goes into mailbox slot k % 2 of the pair: the sender waits
 * until d's `acked` counter reached k - 1 (the slot's previous chunk was taken; no wait for
 * k < 2), writes the message's total byte count, tag and dtype code in the slot's 64-byte
 * header and the chunk after it, then publishes `sent` = k + 1; the receiver waits until `sent`
 * reached k + 1, compares the header's tag (TAG_OTHER), then count and dtype (SIZE_MISMATCH) with
 * its own (either way nothing copied, nothing acknowledged), copies the chunk out and publishes
 * `acked` = k + 1. The caller keeps k (one
 * counter per peer and direction). A waiter about to sleep on a peer's counter announces itself
 * in the word after its own counter of that pair (the sender after its `sent`, the receiver
 * after its `acked`); a publisher wakes the counter's futex only when that announcement is set,
 * after a full fence, so the usual message costs no system call and a sleeper never misses its
 * wakeup (the kernel's futex_wait fences between the announcement and its read of the word).
 *
 * The torch backend's usual send and recv (a Lane, p2p.py's Mailboxes.lane): one contiguous
 * CPU tensor of one chunk, checked, moved, counted and recorded in one call, on the engine's
 * own lists and lock; anything else returns None and Python takes it (the Lane's comment).
 *
 * Contract of the arguments. A SmallCore holds the segment itself (a buffer export: the mapping
 * cannot go away under it) and checks every word index and slot of its layout against it at
 * construction; every later argument is checked against the C type it is used as (ValueError
 * when out of range, TypeError when not an int) before anything is touched. What cannot be
 * checked are the raw addresses of the caller's memory (all_reduce's `user`, `out` and `flat`,
 * reduce's `out` and `terms`, send's and recv's `user`): each must point to at least the bytes
 * the call names (0 bytes: any address), readable and, where written, writable for the whole
 * call, and outside the segment. schedules.py only passes the data pointers of contiguous CPU
 * tensors it checked.
 *
 * Memory ordering: flags are loaded with acquire and stored with release semantics, so data
 * stores before a publish are visible to a peer that sees the flag, on every architecture.
 *
 * Arithmetic: elementwise in the buffers' dtype, one operation per term in rank order, no
 * contraction into FMAs (built with -ffp-contract=off): the bits of torch's add/mul. Integer
 * types wrap (computed unsigned). AVG divides the sum by the term count in a 64-bit type, then
 * stores in the dtype: torch's div_(count) (floats) or div_(count, rounding_mode="trunc")
 * (integers) wherever the count is representable in the dtype.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { K_F32, K_F64, K_I8, K_U8, K_I32, K_I64, K_COUNT };
enum { OP_SUM, OP_PRODUCT, OP_AVG, OP_COUNT }; /* AVG: the sum, divided by the term count */
enum { DONE = 0, ENTER_WAIT = 1, EXCHANGE_WAIT = 2, MISMATCH = 3 };
/* send/recv: the slot is not free yet, no message yet (nothing written either way), the
 * message's byte count differs from the receiver's (nothing copied) */
enum { SLOT_WAIT = 4, MESSAGE_WAIT = 5, SIZE_MISMATCH = 6 };
/* recv: the waiting message carries another tag (nothing copied: the caller sets it aside) */
enum { TAG_OTHER = 7 };
/* bytes of a mailbox slot before the chunk: words 0 the message's total byte count, 1 its tag,
 * 2 its dtype code (0: not said; p2p.py) */
#define MBOX_HEADER 64

static const size_t KIND_SIZE[K_COUNT] = {4, 8, 1, 1, 4, 8};
/* Below this many bytes of input, a reduction keeps the GIL (releasing costs more). */
#define NOGIL_BYTES (256 * 1024)
#define MAX_TERMS 4096
/* reduce_push's chunk: its terms, result and copies stay in L2 (512 KiB a core on EPYC) */
#define PUSH_BYTES (64 * 1024)
#define MAX_RANKS 65536
#define MAX_SPIN_NS 10000000000LL /* 10 s: far beyond any spin budget flags.py hands out */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline uint64_t load_acquire(const uint64_t *word) {
    return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}

/* ------------------------------------------------------------------- argument parsing */

/* An int argument as a signed 64-bit value in [lo, hi]: TypeError if not an int, ValueError
 * (naming it) if out of range, with no truncation before the check. */
static int arg_range(PyObject *obj, long long lo, long long hi, const char *name,
                     long long *out) {
    int overflow = 0;
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (overflow || value < lo || value > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be in [%lld, %lld], got %R", name, lo, hi, obj);
        return -1;
    }
    *out = value;
    return 0;
}

/* An int argument as an unsigned 64-bit value (an address, a descriptor, a seq). */
static int arg_u64(PyObject *obj, const char *name, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be in [0, 2**64), got %R", name, obj);
        return -1;
    }
    *out = value;
    return 0;
}

/* What a null address of 0 bytes (an empty tensor's) stands for: no pointer here is null. */
static char EMPTY[64];

/* An address that may be 0 only when nothing is read or written through it. */
static int arg_address(PyObject *obj, const char *name, size_t nbytes, char **out) {
    uint64_t value;
    if (arg_u64(obj, name, &value) < 0)
        return -1;
    if (value == 0 && nbytes) {
        PyErr_Format(PyExc_ValueError, "%s is a null address for %zu bytes", name, nbytes);
        return -1;
    }
    *out = value ? (char *)(uintptr_t)value : EMPTY;
    return 0;
}

static int check_kind_op(long long kind, long long op, double scale) {
    if (scale != 1.0 && (op != OP_SUM || (kind != K_F32 && kind != K_F64))) {
        PyObject *value = PyFloat_FromDouble(scale);
        if (value) {
            PyErr_Format(PyExc_ValueError,
                         "a scale (got %R) needs op SUM on float32/float64, got kind %lld op %lld",
                         value, kind, op);
            Py_DECREF(value);
        }
        return -1;
    }
    return 0;
}

/* memcpy, skipped when there is nothing to copy (an empty tensor's EMPTY may alias). */
static inline void copy_bytes(char *dst, const char *src, size_t n) {
    if (n)
        memcpy(dst, src, n);
}

/* --------------------------------------------------------------------------- reductions */

#define REDUCE_LOOP(T, EXPR)                                                        \
    do {                                                                            \
        T *o = (T *)out;                                                            \
        const T *a = (const T *)terms[0], *b = (const T *)terms[1];                 \
        for (size_t i = 0; i < n; i++) {                                            \
            T x = a[i], y = b[i];                                                   \
            o[i] = (T)(EXPR);                                                       \
        }                                                                           \
        for (int t = 2; t < nterms; t++) {                                          \
            b = (const T *)terms[t];                                                \
            for (size_t i = 0; i < n; i++) {                                        \
                T x = o[i], y = b[i];                                               \
                o[i] = (T)(EXPR);                                                   \
            }                                                                       \
        }                                                                           \
    } while (0)

/* Every term multiplied by `scale` (rounded in T) before it is added: torch's mul_ then add. */
#define SCALED_SUM_LOOP(T)                                                          \
    do {                                                                            \
        T *o = (T *)out;                                                            \
        const T s = (T)scale;                                                       \
        const T *a = (const T *)terms[0], *b = (const T *)terms[1];                 \
        for (size_t i = 0; i < n; i++) {                                            \
            T x = a[i] * s, y = b[i] * s;                                           \
            o[i] = x + y;                                                           \
        }                                                                           \
        for (int t = 2; t < nterms; t++) {                                          \
            b = (const T *)terms[t];                                                \
            for (size_t i = 0; i < n; i++) {                                        \
                T y = b[i] * s;                                                     \
                o[i] = o[i] + y;                                                    \
            }                                                                       \
        }                                                                           \
    } while (0)

/* o[i] / count in the wide type W, stored back as T: the count never wraps in T. */
#define DIVIDE_LOOP(T, W)                                                           \
    do {                                                                            \
        T *o = (T *)out;                                                            \
        const W d = (W)count;                                                       \
        for (size_t i = 0; i < n; i++)                                              \
            o[i] = (T)((W)o[i] / d);                                                \
    } while (0)

/* out /= count (count >= 1), as torch's div_ (floats: the count is exact in both) or
 * div_(rounding_mode="trunc") (integers: C's division truncates toward zero too). */
static void divide(void *out, size_t n, int kind, int count) {
    switch (kind) {
    case K_F32: DIVIDE_LOOP(float, float); break;
    case K_F64: DIVIDE_LOOP(double, double); break;
    case K_I8: DIVIDE_LOOP(int8_t, int64_t); break;
    case K_U8: DIVIDE_LOOP(uint8_t, uint64_t); break;
    case K_I32: DIVIDE_LOOP(int32_t, int64_t); break;
    case K_I64: DIVIDE_LOOP(int64_t, int64_t); break;
    }
}

/* out = terms[0] (op) terms[1] (op) ... in rank order; nterms >= 2. `out` may alias terms[0]
 * or terms[1] but no later term. A scale other than 1 (floating kinds, SUM) scales each term. */
static void reduce_terms(void *out, char *const *terms, int nterms, size_t n, int kind, int op,
                         double scale) {
    if (scale != 1.0) {
        if (kind == K_F32)
            SCALED_SUM_LOOP(float);
        else
            SCALED_SUM_LOOP(double);
        return;
    }
    if (op == OP_SUM || op == OP_AVG) {
        switch (kind) {
        case K_F32: REDUCE_LOOP(float, x + y); break;
        case K_F64: REDUCE_LOOP(double, x + y); break;
        case K_I8:
        case K_U8: REDUCE_LOOP(uint8_t, x + y); break;
        case K_I32: REDUCE_LOOP(uint32_t, x + y); break;
        case K_I64: REDUCE_LOOP(uint64_t, x + y); break;
        }
        if (op == OP_AVG)
            divide(out, n, kind, nterms);
    } else {
        switch (kind) {
        case K_F32: REDUCE_LOOP(float, x * y); break;
        case K_F64: REDUCE_LOOP(double, x * y); break;
        case K_I8:
        case K_U8: REDUCE_LOOP(uint8_t, (unsigned)x * (unsigned)y); break;
        case K_I32: REDUCE_LOOP(uint32_t, x * y); break;
        case K_I64: REDUCE_LOOP(uint64_t, x * y); break;
        }
    }
}

/* out = terms[0] (op) ... (op) terms[nterms - 1], any nterms >= 1 (one term: a copy, or its
 * product with `scale`; AVG of one term divides by 1). Same aliasing rule as reduce_terms. */
static void reduce_any(char *out, char *const *terms, int nterms, size_t n, int kind, int op,
                       double scale) {
    if (!n)
        return;
    if (nterms >= 2) {
        reduce_terms(out, terms, nterms, n, kind, op, scale);
    } else if (scale != 1.0) {
        if (kind == K_F32) {
            float *o = (float *)out;
            const float *a = (const float *)terms[0], s = (float)scale;
            for (size_t i = 0; i < n; i++)
                o[i] = a[i] * s;
        } else {
            double *o = (double *)out;
            const double *a = (const double *)terms[0];
            for (size_t i = 0; i < n; i++)
                o[i] = a[i] * scale;
        }
    } else if (out != terms[0]) {
        memmove(out, terms[0], n * KIND_SIZE[kind]);
    }
}

/* reduce_any into `out`, then the result copied into every one of `outs`, PUSH_BYTES at a
 * time: each chunk is copied out while it is still in cache, so the copies do not read the
 * result back from memory. Aliasing: `out` as reduce_terms; each of `outs` is one of the terms
 * (the same address: every term of a chunk is read before any output of that chunk is
 * written, and no chunk reads another's elements) or overlaps no term, `out` nor another out.
 * `chunk` is scratch for nterms term pointers. */
static void reduce_push(char *out, char *const *terms, char **chunk, int nterms,
                        char *const *outs, int nouts, size_t n, int kind, int op,
                        double scale) {
    size_t esize = KIND_SIZE[kind], step = PUSH_BYTES / esize;
    for (size_t start = 0; start < n; start += step) {
        size_t count = n - start < step ? n - start : step, off = start * esize;
        for (int t = 0; t < nterms; t++)
            chunk[t] = terms[t] + off;
        reduce_any(out + off, chunk, nterms, count, kind, op, scale);
        for (int k = 0; k < nouts; k++)
            memcpy(outs[k] + off, out + off, count * esize);
    }
}

/* `*addrs` (`*count` entries, PyMem_Malloc'd) from the sequence `seq` (named `what`, each
 * entry `item` in errors) of at least `lo` addresses of `nbytes` each; -1 with an exception. */
static int addresses(PyObject *seq, const char *what, const char *item, int lo, size_t nbytes,
                     Py_ssize_t *count, char ***addrs) {
    PyObject *fast = PySequence_Fast(seq, "terms and outs must be sequences of addresses");
    if (!fast)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    if (len < lo || len > MAX_TERMS) {
        PyErr_Format(PyExc_ValueError, "%s must hold %d to %d addresses, got %zd", what, lo,
                     MAX_TERMS, len);
        Py_DECREF(fast);
        return -1;
    }
    char **out = PyMem_Malloc(sizeof(char *) * (size_t)(len ? len : 1));
    if (!out) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t t = 0; t < len; t++) {
        if (arg_address(PySequence_Fast_GET_ITEM(fast, t), item, nbytes, &out[t]) < 0) {
            PyMem_Free(out);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    *count = len;
    *addrs = out;
    return 0;
}

/* reduce(out, terms, numel, kind, op, scale=1.0, outs=()): module docstring of reduce_terms;
 * with `outs`, reduce_push. */
static PyObject *py_reduce(PyObject *self, PyObject *args) {
    PyObject *out_obj, *seq, *numel_obj, *kind_obj, *op_obj, *outs_obj = NULL;
    double scale = 1.0;
    long long numel, kind, op;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOO|dO", &out_obj, &seq, &numel_obj, &kind_obj, &op_obj,
                          &scale, &outs_obj))
        return NULL;
    if (arg_range(kind_obj, 0, K_COUNT - 1, "kind", &kind) < 0 ||
        arg_range(op_obj, 0, OP_COUNT - 1, "op", &op) < 0 || check_kind_op(kind, op, scale) < 0 ||
        arg_range(numel_obj, 0, PY_SSIZE_T_MAX / 8, "numel", &numel) < 0)
        return NULL;
    size_t n = (size_t)numel, nbytes = n * KIND_SIZE[kind];
    char *out, **terms = NULL, **outs = NULL, **chunk = NULL;
    Py_ssize_t nterms = 0, nouts = 0;
    if (addresses(seq, "terms", "a term", 1, nbytes, &nterms, &terms) < 0)
        return NULL;
    if (outs_obj && outs_obj != Py_None &&
        addresses(outs_obj, "outs", "an out", 0, nbytes, &nouts, &outs) < 0)
        goto fail;
    if (arg_address(out_obj, "out", nbytes, &out) < 0)
        goto fail;
    for (Py_ssize_t k = 0; k < nouts; k++) {
        if (nbytes && outs[k] == out) {
            PyErr_SetString(PyExc_ValueError, "outs must not hold out itself");
            goto fail;
        }
    }
    if (nouts && !(chunk = PyMem_Malloc(sizeof(char *) * (size_t)nterms))) {
        PyErr_NoMemory();
        goto fail;
    }
    int release = nbytes * (size_t)(1 + nouts) >= NOGIL_BYTES;
    PyThreadState *state = release ? PyEval_SaveThread() : NULL;
    if (nouts)
        reduce_push(out, terms, chunk, (int)nterms, outs, (int)nouts, n, (int)kind, (int)op,
                    scale);
    else
        reduce_any(out, terms, (int)nterms, n, (int)kind, (int)op, scale);
    if (release)
        PyEval_RestoreThread(state);
    PyMem_Free(chunk);
    PyMem_Free(outs);
    PyMem_Free(terms);
    Py_RETURN_NONE;
fail:
    PyMem_Free(chunk);
    PyMem_Free(outs);
    PyMem_Free(terms);
    return NULL;
}

/* --------------------------------------------------------------- the small collectives */

typedef struct {
    PyObject_HEAD
    int ready;            /* 0 until __init__ succeeded (a bare __new__ leaves it 0) */
    Py_buffer segment;    /* the mapped segment, held for the object's lifetime */
    uint64_t *words;
    int rank, size;
    size_t slot_bytes;
    Py_ssize_t *seq_idx;  /* [size] */
    Py_ssize_t *wait_idx; /* [size] */
    Py_ssize_t *desc_idx; /* [size][4]: A of half 0, A of half 1, B of half 0, B of half 1 */
    char **slots;         /* [2][size] */
    char **terms;         /* [size]: scratch for one reduction's term addresses */
    int p2p;              /* 1 when built with the mailboxes (send and recv) */
    size_t mbox_bytes;
    /* [size][4] words: this rank's sent to r, r's acked of ours, r's sent to us, our acked of
     * r's; the word after each is its owner's announcement (module docstring) */
    Py_ssize_t *p2p_idx;
    char **mbox;          /* [size][4]: slot 0 and 1 to r, slot 0 and 1 from r */
} SmallCore;

static void SmallCore_dealloc(SmallCore *self) {
    if (self->ready)
        PyBuffer_Release(&self->segment);
    PyMem_Free(self->seq_idx);
    PyMem_Free(self->wait_idx);
    PyMem_Free(self->desc_idx);
    PyMem_Free(self->slots);
    PyMem_Free(self->terms);
    PyMem_Free(self->p2p_idx);
    PyMem_Free(self->mbox);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* `count` entries of `seq`, each in [0, limit). */
static int read_indices(PyObject *seq, Py_ssize_t count, Py_ssize_t limit, Py_ssize_t *out,
                        const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != count) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd entries, got %zd", what, count,
                     PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        long long value;
        if (arg_range(PySequence_Fast_GET_ITEM(fast, i), 0, (long long)limit - 1, what,
                      &value) < 0) {
            Py_DECREF(fast);
            return -1;
        }
        out[i] = (Py_ssize_t)value;
    }
    Py_DECREF(fast);
    return 0;
}

/* SmallCore(segment, rank, seq_idx, wait_idx, desc_idx, slots, slot_bytes): `segment` is a
 * writable, contiguous, 8-byte aligned buffer (the mapping); the index lists are in 8-byte
 * words of it, per rank; `desc_idx` lists each rank's four descriptor words (A of half 0, A of
 * half 1, B of half 0, B of half 1), rank 0 first; `slots` lists the byte offsets of the slots
 * of half 0 for every rank, then of half 1, each 8-byte aligned and `slot_bytes` long inside
 * the buffer. Initialised once: a second __init__ raises (a concurrent call may be using the
 * layout with the GIL released).
 *
 * Send and recv need three more arguments, all or none: `p2p_idx`, for every rank r in rank
 * order, the word indices of this rank's `sent` to r, r's `acked` of this rank's, r's `sent` to
 * this rank and this rank's `acked` of r's (the word after each is its owner's announcement, so
 * each index is below the segment's last word); `mailboxes`, for every r, the byte offsets of
 * this rank's two mailbox slots to r, then of r's two to this rank, each 8-byte aligned and
 * `mbox_bytes` long inside the buffer (entries of r = rank are checked, never used); and
 * `mbox_bytes` (more than the 64-byte header). */
static int SmallCore_init(SmallCore *self, PyObject *args, PyObject *kwds) {
    PyObject *segment, *rank_obj, *seq_idx, *wait_idx, *desc_idx, *slots, *slot_bytes_obj;
    PyObject *p2p_obj = NULL, *mbox_obj = NULL, *mbox_bytes_obj = NULL;
    long long rank, slot_bytes, mbox_bytes = 0;
    if (self->ready) {
        PyErr_SetString(PyExc_ValueError, "SmallCore is already initialised");
        return -1;
    }
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "SmallCore takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOOOOO|OOO", &segment, &rank_obj, &seq_idx, &wait_idx,
                          &desc_idx, &slots, &slot_bytes_obj, &p2p_obj, &mbox_obj,
                          &mbox_bytes_obj))
        return -1;
    if ((p2p_obj != NULL) != (mbox_bytes_obj != NULL)) {
        PyErr_SetString(PyExc_TypeError,
                        "SmallCore takes p2p_idx, mailboxes and mbox_bytes together or none");
        return -1;
    }
    Py_ssize_t size = PySequence_Size(seq_idx);
    if (size < 1 || size > MAX_RANKS) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "seq_idx must list 1 to %d ranks, got %zd",
                         MAX_RANKS, size);
        return -1;
    }
    if (arg_range(rank_obj, 0, size - 1, "rank", &rank) < 0 ||
        arg_range(slot_bytes_obj, 1, PY_SSIZE_T_MAX, "slot_bytes", &slot_bytes) < 0)
        return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(segment, &view, PyBUF_WRITABLE) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "segment must be a writable contiguous buffer (the mapping), got %.100s",
                         Py_TYPE(segment)->tp_name);
        }
        return -1;
    }
    Py_ssize_t nwords = view.len / 8;
    Py_ssize_t *seq = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)size);
    Py_ssize_t *wait = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)size);
    Py_ssize_t *desc = PyMem_Malloc(sizeof(Py_ssize_t) * 4 * (size_t)size);
    Py_ssize_t *offsets = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * (size_t)size);
    char **slot_addr = PyMem_Malloc(sizeof(char *) * 2 * (size_t)size);
    char **terms = PyMem_Malloc(sizeof(char *) * (size_t)size);
    Py_ssize_t *p2p = NULL;
    char **mbox = NULL;
    if (p2p_obj) {
        p2p = PyMem_Malloc(sizeof(Py_ssize_t) * 4 * (size_t)size);
        mbox = PyMem_Malloc(sizeof(char *) * 4 * (size_t)size);
    }
    if (!seq || !wait || !desc || !offsets || !slot_addr || !terms ||
        (p2p_obj && (!p2p || !mbox))) {
        PyErr_NoMemory();
        goto fail;
    }
    if ((uintptr_t)view.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "segment must be 8-byte aligned");
        goto fail;
    }
    if (nwords < 1) {
        PyErr_Format(PyExc_ValueError, "segment must hold at least one word, got %zd bytes",
                     view.len);
        goto fail;
    }
    if (read_indices(seq_idx, size, nwords, seq, "seq_idx") < 0 ||
        read_indices(wait_idx, size, nwords, wait, "wait_idx") < 0 ||
        read_indices(desc_idx, 4 * size, nwords, desc, "desc_idx") < 0)
        goto fail;
    if (slot_bytes > view.len) {
        PyErr_Format(PyExc_ValueError, "slot_bytes %lld exceeds the segment's %zd bytes",
                     slot_bytes, view.len);
        goto fail;
    }
    if (read_indices(slots, 2 * size, view.len - slot_bytes + 1, offsets, "slots") < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < 2 * size; i++) {
        if (offsets[i] % 8) {
            PyErr_Format(PyExc_ValueError, "slots: offset %zd is not 8-byte aligned",
                         offsets[i]);
            goto fail;
        }
        slot_addr[i] = (char *)view.buf + offsets[i];
    }
    if (p2p_obj) {
        if (arg_range(mbox_bytes_obj, MBOX_HEADER + 1, view.len, "mbox_bytes", &mbox_bytes) < 0 ||
            read_indices(p2p_obj, 4 * size, nwords - 1, p2p, "p2p_idx") < 0)
            goto fail;
        PyMem_Free(offsets);
        offsets = PyMem_Malloc(sizeof(Py_ssize_t) * 4 * (size_t)size);
        if (!offsets) {
            PyErr_NoMemory();
            goto fail;
        }
        if (read_indices(mbox_obj, 4 * size, view.len - mbox_bytes + 1, offsets, "mailboxes") < 0)
            goto fail;
        for (Py_ssize_t i = 0; i < 4 * size; i++) {
            if (offsets[i] % 8) {
                PyErr_Format(PyExc_ValueError, "mailboxes: offset %zd is not 8-byte aligned",
                             offsets[i]);
                goto fail;
            }
            mbox[i] = (char *)view.buf + offsets[i];
        }
    }
    PyMem_Free(offsets);
    offsets = NULL;
    if (self->ready) { /* another thread's __init__ won while ours ran Python code */
        PyErr_SetString(PyExc_ValueError, "SmallCore is already initialised");
        goto fail;
    }
    self->segment = view;
    self->words = (uint64_t *)view.buf;
    self->rank = (int)rank;
    self->size = (int)size;
    self->slot_bytes = (size_t)slot_bytes;
    self->seq_idx = seq;
    self->wait_idx = wait;
    self->desc_idx = desc;
    self->slots = slot_addr;
    self->terms = terms;
    self->p2p = p2p_obj != NULL;
    self->mbox_bytes = (size_t)mbox_bytes;
    self->p2p_idx = p2p;
    self->mbox = mbox;
    self->ready = 1;
    return 0;
fail:
    PyMem_Free(p2p);
    PyMem_Free(mbox);
    PyMem_Free(seq);
    PyMem_Free(wait);
    PyMem_Free(desc);
    PyMem_Free(offsets);
    PyMem_Free(slot_addr);
    PyMem_Free(terms);
    PyBuffer_Release(&view);
    return -1;
}

/* Whether every peer's seq reached `target` within `spin_ns` (GIL released while spinning). */
static int peers_reached(SmallCore *self, uint64_t target, int64_t spin_ns) {
    int p = 0;
    for (; p < self->size; p++)
        if (p != self->rank && load_acquire(&self->words[self->seq_idx[p]]) < target)
            break;
    if (p == self->size)
        return 1;
    if (spin_ns <= 0)
        return 0;
    int reached = 1;
    Py_BEGIN_ALLOW_THREADS
    int64_t end = now_ns() + spin_ns;
    for (; p < self->size && reached; p++) {
        if (p == self->rank)
            continue;
        const uint64_t *word = &self->words[self->seq_idx[p]];
        for (;;) {
            int i = 0;
            for (; i < 64 && load_acquire(word) < target; i++)
                cpu_relax();
            if (i < 64)
                break;
            if (now_ns() > end) {
                reached = 0;
                break;
            }
        }
    }
    Py_END_ALLOW_THREADS
    return reached;
}

/* Whether `*word` reached `target` within `spin_ns` (GIL released while spinning). */
static int word_reached(const uint64_t *word, uint64_t target, int64_t spin_ns) {
    if (load_acquire(word) >= target)
        return 1;
    if (spin_ns <= 0)
        return 0;
    int reached = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t end = now_ns() + spin_ns;
    while (!reached) {
        for (int i = 0; i < 64; i++) {
            if (load_acquire(word) >= target) {
                reached = 1;
                break;
            }
            cpu_relax();
        }
        if (!reached && now_ns() > end)
            break;
    }
    Py_END_ALLOW_THREADS
    return reached;
}

enum { C_ALL_REDUCE, C_BROADCAST, C_ALL_GATHER, C_REDUCE_SCATTER, C_ALL_TO_ALL, C_BARRIER,
       C_V_CALL };
/* v_call: the ranks' headers disagree (nothing copied out), or some rank's piece needs more
 * than one round (nothing copied out: Python reads the headers and goes on) */
enum { V_DISAGREE = 7, V_MORE = 8 };
#define V_HEAD 4 /* a v-call header's fixed words (vschedules.py: op, root, dtype, element size) */

/* One round of a small collective (every field checked by its method). */
typedef struct {
    int what;
    char *out;       /* where results land: the tensor (all_reduce, broadcast) or the output */
    char *in;        /* what is copied in: the tensor, or the input (all_gather ...) */
    size_t nbytes;   /* all_reduce, broadcast, all_gather: bytes of `in`; else bytes of a row */
    size_t numel;    /* elements reduced (all_reduce: the tensor; reduce_scatter: a row) */
    int kind, op;
    int root;        /* all_reduce: the root or -1 (every rank); broadcast: the source */
    uint64_t code_a; /* descriptor word A; B is computed (module docstring) */
    const int64_t *plan; /* v_call: header (V_HEAD + 3 size words), out addresses, in addresses */
    int half;
    uint64_t enter, target;
    int stage;
    int64_t spin_ns;
} Round;

/* The round's trailing arguments: code_a, half, enter, target, stage, spin_ns. */
static int parse_tail(PyObject *const *args, Round *r) {
    long long half, stage, spin;
    if (arg_u64(args[0], "code_a", &r->code_a) < 0 ||
        arg_range(args[1], 0, 1, "half", &half) < 0 ||
        arg_u64(args[2], "enter", &r->enter) < 0 || arg_u64(args[3], "target", &r->target) < 0 ||
        arg_range(args[4], 0, 2, "stage", &stage) < 0 ||
        arg_range(args[5], 0, MAX_SPIN_NS, "spin_ns", &spin) < 0)
        return -1;
    r->half = (int)half;
    r->stage = (int)stage;
    r->spin_ns = spin;
    return 0;
}

static int check_ready(SmallCore *self) {
    if (!self->ready) {
        PyErr_SetString(PyExc_ValueError,
                        "SmallCore is not initialised: construct it with SmallCore(...)");
        return -1;
    }
    return 0;
}

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t expected) {
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, expected, nargs);
        return -1;
    }
    return 0;
}

static inline int overlaps(const char *a, size_t alen, const char *b, size_t blen) {
    return alen && blen && a < b + blen && b < a + alen;
}

/* Copies this rank's part in (stage 1, before the publish). */
static void copy_in(SmallCore *self, const Round *r, char **slots) {
    int rank = self->rank, size = self->size;
    char *mine = slots[rank];
    switch (r->what) {
    case C_ALL_REDUCE:
    case C_ALL_GATHER:
        copy_bytes(mine, r->in, r->nbytes);
        break;
    case C_BROADCAST:
        if (rank == r->root)
            copy_bytes(mine, r->in, r->nbytes);
        break;
    case C_REDUCE_SCATTER: { /* the rows the peers reduce; ours is read in place ... */
        size_t row = r->nbytes, before = row * (size_t)rank, after = before + row;
        copy_bytes(mine, r->in, before);
        copy_bytes(mine + after, r->in + after, row * (size_t)size - after);
        /* ... unless the output overlaps it: then from our slot's own row, like the peers' */
        if (overlaps(r->out, row, r->in + before, row))
            copy_bytes(mine + before, r->in + before, row);
        break;
    }
    case C_ALL_TO_ALL:
        copy_bytes(mine, r->in, r->nbytes * (size_t)size);
        break;
    case C_V_CALL: { /* the header, then each distinct buffer sent to a peer at its offset */
        const int64_t *plan = r->plan, *sent = plan + V_HEAD, *offs = plan + V_HEAD + 2 * size;
        const int64_t *ins = plan + V_HEAD + 4 * size;
        memcpy(mine, plan, (size_t)(V_HEAD + 3 * size) * 8);
        for (int d = 0; d < size; d++) {
            if (d == rank || offs[d] < 0 || sent[d] <= 0)
                continue;
            int seen = 0; /* an all_gather_v sends one buffer to everyone: copied once */
            for (int e = 0; e < d && !seen; e++)
                seen = e != rank && offs[e] == offs[d] && sent[e] > 0;
            if (!seen)
                copy_bytes(mine + offs[d], (const char *)(intptr_t)ins[d], (size_t)sent[d]);
        }
        break;
    }
    }
}

/* Bytes of a v-call header: its words, on whole 64-byte lines (vschedules.py). */
static inline size_t v_header_bytes(int size) {
    return ((size_t)(V_HEAD + 3 * size) * 8 + 63) / 64 * 64;
}

/* A v-call's copy-out once every header is in (vschedules.py): V_DISAGREE when the ranks'
 * calls differ, V_MORE when a rank's piece needs more than this round, else DONE. */
static int finish_v(SmallCore *self, const Round *r, char **slots) {
    int rank = self->rank, size = self->size;
    const int64_t *plan = r->plan, *h0 = (const int64_t *)slots[0];
    size_t room_all = self->slot_bytes - v_header_bytes(size);
    for (int q = 0; q < size; q++) {
        const int64_t *hq = (const int64_t *)slots[q];
        if (hq[0] != h0[0] || hq[1] != h0[1] || hq[2] != h0[2])
            return V_DISAGREE;
        for (int d = 0; d < size; d++)
            if (hq[V_HEAD + d] != ((const int64_t *)slots[d])[V_HEAD + size + q])
                return V_DISAGREE;
    }
    for (int q = 0; q < size; q++) {
        const int64_t *hq = (const int64_t *)slots[q], *offs = hq + V_HEAD + 2 * size;
        int distinct = 0;
        for (int d = 0; d < size; d++) {
            int seen = offs[d] < 0;
            for (int e = 0; e < d && !seen; e++)
                seen = offs[e] == offs[d];
            distinct += !seen;
        }
        size_t room = room_all / (size_t)(distinct ? distinct : 1) / 64 * 64;
        for (int d = 0; d < size; d++)
            if (offs[d] >= 0 && (size_t)hq[V_HEAD + d] > room)
                return V_MORE;
    }
    const int64_t *expected = plan + V_HEAD + size, *outs = plan + V_HEAD + 3 * size;
    const int64_t *ins = outs + size;
    if (expected[rank] > 0) /* first: the peers' pieces may land on our own input */
        memmove((char *)(intptr_t)outs[rank], (const char *)(intptr_t)ins[rank],
                (size_t)expected[rank]);
    for (int q = 0; q < size; q++) {
        if (q == rank || expected[q] <= 0)
            continue;
        const int64_t *hq = (const int64_t *)slots[q];
        copy_bytes((char *)(intptr_t)outs[q], slots[q] + hq[V_HEAD + 2 * size + rank],
                   (size_t)expected[q]);
    }
    return DONE;
}

/* Copies out or reduces (stage 2, after every descriptor matched); returns the status. */
static int finish(SmallCore *self, const Round *r, char **slots) {
    int rank = self->rank, size = self->size;
    size_t row = r->nbytes;
    switch (r->what) {
    case C_V_CALL:
        return finish_v(self, r, slots);
    case C_ALL_REDUCE:
        if (r->root < 0 || r->root == rank)
            reduce_any(r->out, slots, size, r->numel, r->kind, r->op, 1.0);
        break;
    case C_BROADCAST:
        if (rank != r->root)
            copy_bytes(r->out, slots[r->root], row);
        break;
    case C_ALL_GATHER:
        for (int q = 0; q < size; q++)
            copy_bytes(r->out + row * (size_t)q, slots[q], row);
        break;
    case C_REDUCE_SCATTER: {
        char *own = r->in + row * (size_t)rank;
        if (overlaps(r->out, row, own, row))
            own = slots[rank] + row * (size_t)rank;
        for (int q = 0; q < size; q++)
            self->terms[q] = q == rank ? own : slots[q] + row * (size_t)rank;
        reduce_any(r->out, self->terms, size, r->numel, r->kind, r->op, 1.0);
        break;
    }
    case C_ALL_TO_ALL:
        for (int q = 0; q < size; q++)
            copy_bytes(r->out + row * (size_t)q, slots[q] + row * (size_t)rank, row);
        break;
    }
    return DONE;
}

/* Runs (or resumes, from r->stage) one round: the module docstring's stages. */
static PyObject *run_round(SmallCore *self, Round *r) {
    int rank = self->rank, size = self->size, half = r->half;
    char **slots = self->slots + half * size;
    uint64_t *words = self->words;
    const Py_ssize_t *desc = self->desc_idx;
    uint64_t code_b = 0;
    if (r->what == C_BROADCAST || (r->what == C_ALL_REDUCE && r->root >= 0))
        code_b = (uint64_t)r->root + 1;
    if (r->stage == 0) {
        if (!peers_reached(self, r->enter, r->spin_ns))
            return PyLong_FromLong(ENTER_WAIT);
    } else if (r->stage == 1 && !peers_reached(self, r->enter, 0)) {
        return PyLong_FromLong(ENTER_WAIT); /* resumed too early: nothing written yet */
    }
    if (r->stage <= 1) {
        __atomic_store_n(&words[desc[4 * rank + half]], r->code_a, __ATOMIC_RELAXED);
        __atomic_store_n(&words[desc[4 * rank + 2 + half]], code_b, __ATOMIC_RELAXED);
        copy_in(self, r, slots);
        uint64_t *mine = &words[self->seq_idx[rank]];
        __atomic_store_n(mine, r->target, __ATOMIC_RELEASE);
        /* a sleeper announces itself in its waiting_on word (peer rank + 1); the fence orders
         * the publish before that read (else a sleeper may miss this wakeup for one slice) */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        for (int p = 0; p < size; p++) {
            if (p != rank &&
                __atomic_load_n(&words[self->wait_idx[p]], __ATOMIC_RELAXED) ==
                    (uint64_t)rank + 1) {
                syscall(SYS_futex, mine, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
                break;
            }
        }
        if (!peers_reached(self, r->target, r->spin_ns))
            return PyLong_FromLong(EXCHANGE_WAIT);
    } else if (!peers_reached(self, r->target, 0)) {
        return PyLong_FromLong(EXCHANGE_WAIT); /* resumed too early: published, not finished */
    }
    for (int p = 0; p < size; p++) {
        if (p == rank)
            continue;
        if (__atomic_load_n(&words[desc[4 * p + half]], __ATOMIC_RELAXED) != r->code_a ||
            __atomic_load_n(&words[desc[4 * p + 2 + half]], __ATOMIC_RELAXED) != code_b)
            return PyLong_FromLong(MISMATCH);
    }
    return PyLong_FromLong(finish(self, r, slots));
}

#define STATUS_DOC                                                                            \
    "Returns DONE (0), ENTER_WAIT (1: nothing written yet), EXCHANGE_WAIT (2: published, "   \
    "peers not all there) or MISMATCH (3: a peer's descriptor differs; nothing copied out or " \
    "reduced). The last six arguments: code_a, half, enter, target, stage, spin_ns (module "  \
    "source)."

/* all_reduce(user, numel, kind, op, root, <tail>): in place, of `numel` elements at `user`;
 * root -1: every rank gets the result, else only rank `root` (a reduce). */
static PyObject *SmallCore_all_reduce(SmallCore *self, PyObject *const *args, Py_ssize_t nargs) {
    Round r = {.what = C_ALL_REDUCE};
    long long numel, kind, op, root;
    if (check_ready(self) < 0 || check_nargs("all_reduce", nargs, 11) < 0)
        return NULL;
    if (arg_range(args[2], 0, K_COUNT - 1, "kind", &kind) < 0 ||
        arg_range(args[3], 0, OP_COUNT - 1, "op", &op) < 0 ||
        arg_range(args[1], 0, (long long)(self->slot_bytes / KIND_SIZE[kind]), "numel",
                  &numel) < 0 ||
        arg_range(args[4], -1, self->size - 1, "root", &root) < 0 || parse_tail(args + 5, &r) < 0)
        return NULL;
    r.numel = (size_t)numel;
    r.nbytes = r.numel * KIND_SIZE[kind];
    if (arg_address(args[0], "user", r.nbytes, &r.in) < 0)
        return NULL;
    r.out = r.in;
    r.kind = (int)kind;
    r.op = (int)op;
    r.root = (int)root;
    return run_round(self, &r);
}

/* broadcast(user, nbytes, src, <tail>): `nbytes` at `user` from rank `src` to every rank. */
static PyObject *SmallCore_broadcast(SmallCore *self, PyObject *const *args, Py_ssize_t nargs) {
    Round r = {.what = C_BROADCAST};
    long long nbytes, src;
    if (check_ready(self) < 0 || check_nargs("broadcast", nargs, 9) < 0)
        return NULL;
    if (arg_range(args[1], 0, (long long)self->slot_bytes, "nbytes", &nbytes) < 0 ||
        arg_range(args[2], 0, self->size - 1, "src", &src) < 0 || parse_tail(args + 3, &r) < 0)
        return NULL;
    r.nbytes = (size_t)nbytes;
    if (arg_address(args[0], "user", r.nbytes, &r.in) < 0)
        return NULL;
    r.out = r.in;
    r.root = (int)src;
    return run_round(self, &r);
}

/* all_gather(out, flat, nbytes, <tail>): `nbytes` at `flat` from every rank into `out`
 * (size * nbytes, rank order). */
static PyObject *SmallCore_all_gather(SmallCore *self, PyObject *const *args, Py_ssize_t nargs) {
    Round r = {.what = C_ALL_GATHER};
    long long nbytes;
    if (check_ready(self) < 0 || check_nargs("all_gather", nargs, 9) < 0)
        return NULL;
    if (arg_range(args[2], 0, (long long)self->slot_bytes, "nbytes", &nbytes) < 0 ||
        parse_tail(args + 3, &r) < 0)
        return NULL;
    r.nbytes = (size_t)nbytes;
    if (arg_address(args[0], "out", r.nbytes * (size_t)self->size, &r.out) < 0 ||
        arg_address(args[1], "flat", r.nbytes, &r.in) < 0)
        return NULL;
    return run_round(self, &r);
}

/* reduce_scatter(out, flat, numel, kind, op, <tail>): `flat` holds size rows of `numel`
 * elements; `out` (numel elements) gets row `rank` reduced over every rank. */
static PyObject *SmallCore_reduce_scatter(SmallCore *self, PyObject *const *args,
                                          Py_ssize_t nargs) {
    Round r = {.what = C_REDUCE_SCATTER};
    long long numel, kind, op;
    if (check_ready(self) < 0 || check_nargs("reduce_scatter", nargs, 11) < 0)
        return NULL;
    if (arg_range(args[3], 0, K_COUNT - 1, "kind", &kind) < 0 ||
        arg_range(args[4], 0, OP_COUNT - 1, "op", &op) < 0 ||
        arg_range(args[2], 0,
                  (long long)(self->slot_bytes / KIND_SIZE[kind] / (size_t)self->size), "numel",
                  &numel) < 0 ||
        parse_tail(args + 5, &r) < 0)
        return NULL;
    r.numel = (size_t)numel;
    r.nbytes = r.numel * KIND_SIZE[kind];
    if (arg_address(args[0], "out", r.nbytes, &r.out) < 0 ||
        arg_address(args[1], "flat", r.nbytes * (size_t)self->size, &r.in) < 0)
        return NULL;
    r.kind = (int)kind;
    r.op = (int)op;
    return run_round(self, &r);
}

/* all_to_all(out, flat, row_bytes, <tail>): row q of `flat` goes to rank q; row q of `out`
 * comes from rank q (size rows of row_bytes each). */
static PyObject *SmallCore_all_to_all(SmallCore *self, PyObject *const *args, Py_ssize_t nargs) {
    Round r = {.what = C_ALL_TO_ALL};
    long long row;
    if (check_ready(self) < 0 || check_nargs("all_to_all", nargs, 9) < 0)
        return NULL;
    if (arg_range(args[2], 0, (long long)(self->slot_bytes / (size_t)self->size), "row_bytes",
                  &row) < 0 ||
        parse_tail(args + 3, &r) < 0)
        return NULL;
    r.nbytes = (size_t)row;
    if (arg_address(args[0], "out", r.nbytes * (size_t)self->size, &r.out) < 0 ||
        arg_address(args[1], "flat", r.nbytes * (size_t)self->size, &r.in) < 0)
        return NULL;
    return run_round(self, &r);
}

/* v_call(plan, <tail>): a v-call that fits one round on this rank (vschedules.py). `plan`: the
 * address of V_HEAD + 5 size int64 words: this rank's header (kind, root, dtype, element size;
 * bytes sent to each rank; bytes expected from each; the slot offset of the buffer sent to each,
 * -1 for none), then each output's address, then each input's. Every buffer sent to a peer
 * must lie inside the slot after the header (checked); the addresses as the module docstring
 * says. */
static PyObject *SmallCore_v_call(SmallCore *self, PyObject *const *args, Py_ssize_t nargs) {
    Round r = {.what = C_V_CALL};
    uint64_t plan;
    if (check_ready(self) < 0 || check_nargs("v_call", nargs, 7) < 0 ||
        arg_u64(args[0], "plan", &plan) < 0 || parse_tail(args + 1, &r) < 0)
        return NULL;
    if (!plan) {
        PyErr_SetString(PyExc_ValueError, "v_call: plan is a null address");
        return NULL;
    }
    r.plan = (const int64_t *)(intptr_t)plan;
    int size = self->size;
    size_t lo = v_header_bytes(size);
    for (int d = 0; d < size; d++) {
        int64_t sent = r.plan[V_HEAD + d], off = r.plan[V_HEAD + 2 * size + d];
        if (sent < 0 || r.plan[V_HEAD + size + d] < 0 ||
            (d != self->rank && sent > 0 &&
             (off < (int64_t)lo || (uint64_t)off + (uint64_t)sent > self->slot_bytes))) {
            PyErr_Format(PyExc_ValueError,
                         "v_call: the piece for rank %d (%lld bytes at slot offset %lld) is not "
                         "inside the slot after the header (%zu..%zu)", d, (long long)sent,
                         (long long)off, lo, self->slot_bytes);
            return NULL;
        }
    }
    return run_round(self, &r);
}

/* barrier(<tail>): a round with nothing copied. */
static PyObject *SmallCore_barrier(SmallCore *self, PyObject *const *args, Py_ssize_t nargs) {
    Round r = {.what = C_BARRIER};
    if (check_ready(self) < 0 || check_nargs("barrier", nargs, 6) < 0 || parse_tail(args, &r) < 0)
        return NULL;
    return run_round(self, &r);
}

/* ------------------------------------------------------------------- point to point */

/* Stores `value` in this rank's counter `idx` (release: the chunk's bytes, or its reads, come
 * first) and wakes the counter's sleepers when its waiter announced itself in `announce_idx`.
 * The fence orders the store before that read: a waiter that announced before it is woken, one
 * that announces after it sees the value (futex_wait fences and re-reads the word). */
static void post_counter(uint64_t *words, Py_ssize_t idx, uint64_t value,
                         Py_ssize_t announce_idx) {
    __atomic_store_n(&words[idx], value, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&words[announce_idx], __ATOMIC_RELAXED))
        syscall(SYS_futex, &words[idx], FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* The arguments send and recv share: user, nbytes, total, peer, k, spin_ns and, optionally
 * (both or neither; 0 when left out), the message's tag and dtype code. */
typedef struct {
    char *user;
    size_t nbytes;
    uint64_t total, k, tag, dtype;
    int peer;
    int64_t spin_ns;
} Chunk;

static int parse_chunk(SmallCore *self, const char *name, PyObject *const *args,
                       Py_ssize_t nargs, Chunk *c) {
    long long nbytes, total, peer, spin;
    if (check_ready(self) < 0 || check_nargs(name, nargs, nargs == 8 ? 8 : 6) < 0)
        return -1;
    if (!self->p2p) {
        PyErr_Format(PyExc_ValueError, "%s: this SmallCore was built without mailboxes", name);
        return -1;
    }
    if (arg_range(args[1], 0, (long long)(self->mbox_bytes - MBOX_HEADER), "nbytes", &nbytes) < 0 ||
        arg_range(args[2], 0, LLONG_MAX, "total", &total) < 0 ||
        arg_range(args[3], 0, self->size - 1, "peer", &peer) < 0 ||
        arg_u64(args[4], "k", &c->k) < 0 ||
        arg_range(args[5], 0, MAX_SPIN_NS, "spin_ns", &spin) < 0)
        return -1;
    c->tag = c->dtype = 0;
    if (nargs == 8 && (arg_u64(args[6], "tag", &c->tag) < 0 ||
                       arg_u64(args[7], "dtype", &c->dtype) < 0))
        return -1;
    if (peer == self->rank) {
        PyErr_Format(PyExc_ValueError, "%s: peer %lld is this rank", name, peer);
        return -1;
    }
    c->nbytes = (size_t)nbytes;
    c->total = (uint64_t)total;
    c->peer = (int)peer;
    c->spin_ns = spin;
    return arg_address(args[0], "user", c->nbytes, &c->user);
}

/* A chunk of 64 KiB or more is copied without the GIL (tens of microseconds: the other lanes'
 * threads, a send and a recv in both directions at once, copy meanwhile); a smaller one keeps it
 * (releasing costs more than the copy). */
#define NOGIL_COPY_BYTES (64 * 1024)
static void copy_chunk(char *dst, const char *src, size_t n) {
    if (n < NOGIL_COPY_BYTES) {
        copy_bytes(dst, src, n);
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    memcpy(dst, src, n);
    Py_END_ALLOW_THREADS
}

/* Chunk c.k of a message of c.total bytes to rank c.peer (module docstring): a status. */
static int chunk_send(SmallCore *self, const Chunk *c) {
    const Py_ssize_t *idx = self->p2p_idx + 4 * c->peer;
    uint64_t *words = self->words;
    if (c->k >= 2 && !word_reached(&words[idx[1]], c->k - 1, c->spin_ns))
        return SLOT_WAIT;
    char *box = self->mbox[4 * c->peer + (c->k & 1)];
    uint64_t header[3] = {c->total, c->tag, c->dtype};
    memcpy(box, header, sizeof header);
    copy_chunk(box + MBOX_HEADER, c->user, c->nbytes);
    post_counter(words, idx[0], c->k + 1, idx[1] + 1);
    return DONE;
}

/* Chunk c.k of a message from rank c.peer into c.nbytes at c.user, when the message's header
 * says c.total bytes (module docstring): a status. */
static int chunk_recv(SmallCore *self, const Chunk *c) {
    const Py_ssize_t *idx = self->p2p_idx + 4 * c->peer;
    uint64_t *words = self->words;
    if (!word_reached(&words[idx[2]], c->k + 1, c->spin_ns))
        return MESSAGE_WAIT;
    const char *box = self->mbox[4 * c->peer + 2 + (c->k & 1)];
    uint64_t header[3];
    memcpy(header, box, sizeof header);
    if (header[1] != c->tag)
        return TAG_OTHER;
    /* a dtype code of 0 on either side is not compared (the communicator's untagged calls) */
    if (header[0] != c->total || (c->dtype && header[2] && header[2] != c->dtype))
        return SIZE_MISMATCH;
    copy_chunk(c->user, box + MBOX_HEADER, c->nbytes);
    post_counter(words, idx[3], c->k + 1, idx[2] + 1);
    return DONE;
}

/* send(user, nbytes, total, dst, k, spin_ns): chunk k (`nbytes` at `user`) of a message of
 * `total` bytes to rank `dst` (module docstring). */
static PyObject *SmallCore_send(SmallCore *self, PyObject *const *args, Py_ssize_t nargs) {
    Chunk c;
    if (parse_chunk(self, "send", args, nargs, &c) < 0)
        return NULL;
    return PyLong_FromLong(chunk_send(self, &c));
}

/* recv(user, nbytes, total, src, k, spin_ns): chunk k of a message from rank `src` into
 * `nbytes` at `user`, when the message's header says `total` bytes (module docstring). */
static PyObject *SmallCore_recv(SmallCore *self, PyObject *const *args, Py_ssize_t nargs) {
    Chunk c;
    if (parse_chunk(self, "recv", args, nargs, &c) < 0)
        return NULL;
    return PyLong_FromLong(chunk_recv(self, &c));
}

#define P2P_DOC                                                                               \
    "Returns DONE (0), SLOT_WAIT (4: send: the slot's last chunk not taken yet), MESSAGE_WAIT " \
    "(5: recv: no chunk yet), SIZE_MISMATCH (6: recv: the header's total or dtype differs; "    \
    "nothing copied) or TAG_OTHER (7: recv: the header's tag differs; nothing copied). Nothing " \
    "is written before a wait status (module source)."

#define METHOD(name, doc)                                                                     \
    { #name, (PyCFunction)(void (*)(void))SmallCore_##name, METH_FASTCALL, doc STATUS_DOC }

static PyMethodDef SmallCore_methods[] = {
    METHOD(all_reduce, "all_reduce(user, numel, kind, op, root, code_a, half, enter, target, "
                       "stage, spin_ns) -> status: in place; root -1 for every rank. "),
    METHOD(broadcast, "broadcast(user, nbytes, src, code_a, half, enter, target, stage, "
                      "spin_ns) -> status. "),
    METHOD(all_gather, "all_gather(out, flat, nbytes, code_a, half, enter, target, stage, "
                       "spin_ns) -> status. "),
    METHOD(reduce_scatter, "reduce_scatter(out, flat, numel, kind, op, code_a, half, enter, "
                           "target, stage, spin_ns) -> status: numel of one row. "),
    METHOD(all_to_all, "all_to_all(out, flat, row_bytes, code_a, half, enter, target, stage, "
                       "spin_ns) -> status. "),
    METHOD(barrier, "barrier(code_a, half, enter, target, stage, spin_ns) -> status. "),
    METHOD(v_call, "v_call(plan, code_a, half, enter, target, stage, spin_ns) -> status: a "
                   "v-call of one round; also V_DISAGREE (7) or V_MORE (8), nothing copied "
                   "out. "),
    {"send", (PyCFunction)(void (*)(void))SmallCore_send, METH_FASTCALL,
     "send(user, nbytes, total, dst, k, spin_ns[, tag, dtype]) -> status: chunk k of a message "
     "of total bytes. " P2P_DOC},
    {"recv", (PyCFunction)(void (*)(void))SmallCore_recv, METH_FASTCALL,
     "recv(user, nbytes, total, src, k, spin_ns[, tag, dtype]) -> status: chunk k of a message "
     "of total bytes. " P2P_DOC},
    {NULL, NULL, 0, NULL},
};

static PyObject *SmallCore_get_slot_bytes(SmallCore *self, void *closure) {
    (void)closure;
    if (check_ready(self) < 0)
        return NULL;
    return PyLong_FromSize_t(self->slot_bytes);
}

static PyGetSetDef SmallCore_getset[] = {
    {"slot_bytes", (getter)SmallCore_get_slot_bytes, NULL, "Bytes of one slot.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SmallCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fastcomm.comm.shm._core.SmallCore",
    .tp_basicsize = sizeof(SmallCore),
    .tp_dealloc = (destructor)SmallCore_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The small collectives (one round each) and the one-slot send/recv chunks of one "
              "rank over a mapped shm segment.",
    .tp_methods = SmallCore_methods,
    .tp_getset = SmallCore_getset,
    .tp_init = (initproc)SmallCore_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ the usual send and recv */

/* A Lane runs the torch backend's usual send and recv (c10d/p2p.py) in one call: one
 * contiguous CPU tensor of at most one chunk to or from another rank, an int tag, the
 * communicator usable, nothing queued on the pair, no rejection notice pending and no profiler
 * running. It moves the chunk under the engine's lock as the engine's own one-chunk path does
 * (shm/p2p.py), counts the call in the communicator's statistics, writes its flight record's
 * slot (completed) and returns the call's finished handle. Any other call returns None before
 * anything is done (the Python path takes it); a peer not ready within the spin budget returns
 * False, nothing done (the Python path queues the operation without trying again). Every list
 * and dict it writes belongs to the engine, the streams, the statistics or the recorder, as
 * shm/p2p.py hands them over; it keeps only the two handles it reuses. */
typedef struct {
    PyObject_HEAD
    SmallCore *core;
    Py_ssize_t room;          /* the most bytes of one chunk */
    Py_ssize_t capacity;      /* the flight record's slots (0: no recorder) */
    long long sample_mask;    /* a sequence number with none of these bits set is timed */
    int completed;            /* the slot state of a completed call */
    int reuse;                /* finished handles are reused when nobody else holds them */
    PyObject *engine, *sends, *incoming, *stash, *wanted, *rejects_seen, *sent, *received,
        *acquire, *release, *spin_budget, *comm, *calls, *bytes, *recorder, *rec_op, *rec_arg,
        *rec_extra, *rec_state, *rec_t0, *rec_t1, *profiler, *codes, *tensor_type, *strided,
        *done_type, *received_type, *increment_version, *done_kept[2], *received_kept[2];
} Lane;

#define LANE_OBJECTS(X)                                                                       \
    X(engine) X(sends) X(incoming) X(stash) X(wanted) X(rejects_seen) X(sent) X(received)     \
    X(acquire) X(release) X(spin_budget) X(comm) X(calls) X(bytes) X(recorder) X(rec_op)      \
    X(rec_arg) X(rec_extra) X(rec_state) X(rec_t0) X(rec_t1) X(profiler) X(codes)             \
    X(tensor_type) X(strided) X(done_type) X(received_type) X(increment_version)             \
    X(done_kept[0]) X(done_kept[1]) X(received_kept[0]) X(received_kept[1])

static PyObject *S_IS_CPU, *S_LAYOUT, *S_IS_CONTIGUOUS, *S_DTYPE, *S_NBYTES, *S_DATA_PTR,
    *S_NUMEL, *S_CLOSED, *S_BROKEN, *S_WANTED_ANY, *S_SEQ, *S_LAST, *S_PREV, *S_OUTPUTS, *S_SRC,
    *S_ENABLED, *S_SEND, *S_RECV;

static int intern_names(void) {
    struct { PyObject **slot; const char *text; } names[] = {
        {&S_IS_CPU, "is_cpu"}, {&S_LAYOUT, "layout"}, {&S_IS_CONTIGUOUS, "is_contiguous"},
        {&S_DTYPE, "dtype"}, {&S_NBYTES, "nbytes"}, {&S_DATA_PTR, "data_ptr"},
        {&S_NUMEL, "numel"}, {&S_CLOSED, "_closed"}, {&S_BROKEN, "_broken"},
        {&S_WANTED_ANY, "_wanted_any"}, {&S_SEQ, "seq"}, {&S_LAST, "_last"}, {&S_PREV, "_prev"},
        {&S_OUTPUTS, "_outputs"}, {&S_SRC, "_src"}, {&S_ENABLED, "_is_profiler_enabled"},
        {&S_SEND, "send"}, {&S_RECV, "recv"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (!(*names[i].slot = PyUnicode_InternFromString(names[i].text)))
            return -1;
    return 0;
}

static int Lane_traverse(Lane *self, visitproc visit, void *arg) {
    Py_VISIT(self->core);
#define VISIT(name) Py_VISIT(self->name);
    LANE_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int Lane_clear(Lane *self) {
    Py_CLEAR(self->core);
#define CLEAR(name) Py_CLEAR(self->name);
    LANE_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void Lane_dealloc(Lane *self) {
    PyObject_GC_UnTrack(self);
    Lane_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Lane(core, engine, sends, incoming, stash, wanted, rejects_seen, sent, received, lock,
 * spin_budget, room, comm, calls, bytes, recorder, record, profiler, codes, tensor_type,
 * strided, done_type, received_type, increment_version, reuse): shm/p2p.py's
 * Mailboxes.lane names each; `record` is FlightRecorder.slots() (or None without a
 * recorder). */
static int Lane_init(Lane *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"core", "engine", "sends", "incoming", "stash", "wanted",
                             "rejects_seen", "sent", "received", "lock", "spin_budget", "room",
                             "comm", "calls", "bytes", "recorder", "record", "profiler",
                             "codes", "tensor_type", "strided", "done_type", "received_type",
                             "increment_version", "reuse", NULL};
    PyObject *core, *engine, *sends, *incoming, *stash, *wanted, *rejects_seen, *sent,
        *received, *lock, *spin_budget, *comm, *calls, *bytes, *recorder, *record, *profiler,
        *codes, *tensor_type, *strided, *done_type, *received_type, *increment_version;
    Py_ssize_t room;
    int reuse;
    if (self->core) {
        PyErr_SetString(PyExc_ValueError, "Lane is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "$O!OO!O!O!O!O!O!O!OOnOO!O!OOOO!OOOOOp", kwlist, &SmallCoreType, &core,
            &engine, &PyList_Type, &sends, &PyList_Type, &incoming, &PyList_Type, &stash,
            &PyList_Type, &wanted, &PyList_Type, &rejects_seen, &PyList_Type, &sent,
            &PyList_Type, &received, &lock, &spin_budget, &room, &comm, &PyDict_Type, &calls,
            &PyDict_Type, &bytes, &recorder, &record, &profiler, &PyDict_Type, &codes,
            &tensor_type, &strided, &done_type, &received_type, &increment_version, &reuse))
        return -1;
    SmallCore *sc = (SmallCore *)core;
    if (check_ready(sc) < 0)
        return -1;
    Py_ssize_t n = sc->size;
    PyObject *lists[] = {sends, incoming, stash, wanted, rejects_seen, sent, received};
    for (size_t i = 0; i < sizeof(lists) / sizeof(lists[0]); i++)
        if (PyList_GET_SIZE(lists[i]) != n) {
            PyErr_Format(PyExc_ValueError, "Lane: every per-rank list needs %zd entries", n);
            return -1;
        }
    if (!sc->p2p || room < 0 || (size_t)room > sc->mbox_bytes - MBOX_HEADER) {
        PyErr_Format(PyExc_ValueError, "Lane: room %zd does not fit this core's mailboxes", room);
        return -1;
    }
    if (!PyType_Check(tensor_type)) {
        PyErr_SetString(PyExc_TypeError, "Lane: tensor_type must be a type");
        return -1;
    }
    PyObject *slots[6] = {NULL};
    if (recorder != Py_None) {
        long long capacity, mask, completed;
        if (!PyTuple_Check(record) || PyTuple_GET_SIZE(record) != 9 ||
            !PyArg_ParseTuple(record, "O!O!O!O!O!O!LLL", &PyList_Type, &slots[0], &PyList_Type,
                              &slots[1], &PyList_Type, &slots[2], &PyByteArray_Type, &slots[3],
                              &PyList_Type, &slots[4], &PyList_Type, &slots[5], &capacity,
                              &mask, &completed)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "Lane: record must be the recorder's slots()");
            return -1;
        }
        for (int i = 0; i < 6; i++)
            if ((i == 3 ? PyByteArray_GET_SIZE(slots[i]) : PyList_GET_SIZE(slots[i])) !=
                capacity) {
                PyErr_SetString(PyExc_ValueError, "Lane: the record's slots need capacity entries");
                return -1;
            }
        if (capacity < 1 || completed < 0 || completed > 255) {
            PyErr_SetString(PyExc_ValueError, "Lane: bad record capacity or state");
            return -1;
        }
        self->capacity = (Py_ssize_t)capacity;
        self->sample_mask = mask;
        self->completed = (int)completed;
    }
    PyObject *acquire = PyObject_GetAttrString(lock, "acquire");
    PyObject *release = acquire ? PyObject_GetAttrString(lock, "release") : NULL;
    if (!release) {
        Py_XDECREF(acquire);
        return -1;
    }
    self->acquire = acquire;
    self->release = release;
    self->room = room;
    self->reuse = reuse;
    self->core = (SmallCore *)Py_NewRef(core);
#define KEEP(name) self->name = Py_NewRef(name);
    KEEP(engine) KEEP(sends) KEEP(incoming) KEEP(stash) KEEP(wanted) KEEP(rejects_seen)
    KEEP(sent) KEEP(received) KEEP(spin_budget) KEEP(comm) KEEP(calls) KEEP(bytes)
    KEEP(recorder) KEEP(profiler) KEEP(codes) KEEP(tensor_type) KEEP(strided) KEEP(done_type)
    KEEP(received_type) KEEP(increment_version)
#undef KEEP
    self->rec_op = Py_XNewRef(slots[0]);
    self->rec_arg = Py_XNewRef(slots[1]);
    self->rec_extra = Py_XNewRef(slots[2]);
    self->rec_state = Py_XNewRef(slots[3]);
    self->rec_t0 = Py_XNewRef(slots[4]);
    self->rec_t1 = Py_XNewRef(slots[5]);
    return 0;
}

/* 1 when the new reference `obj` is true, 0 when false, -1 on an error (obj NULL). */
static int truth_of(PyObject *obj) {
    if (!obj)
        return -1;
    int truth = PyObject_IsTrue(obj);
    Py_DECREF(obj);
    return truth;
}

/* An exact int in [0, size) other than this rank. */
static int lane_peer(Lane *self, PyObject *obj, int *peer) {
    if (!PyLong_CheckExact(obj))
        return 0;
    int overflow;
    long value = PyLong_AsLongAndOverflow(obj, &overflow);
    if (overflow || value < 0 || value >= self->core->size || value == self->core->rank)
        return 0;
    *peer = (int)value;
    return 1;
}

/* The call's tensor, `tensors` being a list of one exact torch.Tensor, CPU, strided,
 * contiguous, of a dtype with a header code and at most `room` bytes: 1 with its address,
 * bytes, code and dtype (a new reference), 0 for any other call, -1 on an error. */
static int lane_tensor(Lane *self, PyObject *tensors, char **addr, Py_ssize_t *nbytes,
                       uint64_t *code, PyObject **dtype) {
    if (!PyList_CheckExact(tensors) || PyList_GET_SIZE(tensors) != 1)
        return 0;
    PyObject *t = PyList_GET_ITEM(tensors, 0);
    if ((PyObject *)Py_TYPE(t) != self->tensor_type)
        return 0;
    int ok = truth_of(PyObject_GetAttr(t, S_IS_CPU));
    if (ok <= 0)
        return ok;
    PyObject *layout = PyObject_GetAttr(t, S_LAYOUT);
    if (!layout)
        return -1;
    ok = layout == self->strided;
    Py_DECREF(layout);
    if (!ok)
        return 0;
    ok = truth_of(PyObject_CallMethodNoArgs(t, S_IS_CONTIGUOUS));
    if (ok <= 0)
        return ok;
    PyObject *dt = PyObject_GetAttr(t, S_DTYPE);
    if (!dt)
        return -1;
    PyObject *found = PyDict_GetItemWithError(self->codes, dt); /* borrowed */
    PyObject *size = found ? PyObject_GetAttr(t, S_NBYTES) : NULL;
    PyObject *ptr = size ? PyObject_CallMethodNoArgs(t, S_DATA_PTR) : NULL;
    if (!ptr) {
        Py_XDECREF(size);
        Py_DECREF(dt);
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_ssize_t n = PyLong_AsSsize_t(size);
    unsigned long long c = PyLong_AsUnsignedLongLong(found);
    void *p = PyLong_AsVoidPtr(ptr);
    Py_DECREF(size);
    Py_DECREF(ptr);
    if (PyErr_Occurred()) {
        Py_DECREF(dt);
        return -1;
    }
    if (n < 0 || n > self->room || (!p && n)) {
        Py_DECREF(dt);
        return 0;
    }
    *addr = p ? (char *)p : EMPTY;
    *nbytes = n;
    *code = c;
    *dtype = dt;
    return 1;
}

/* 1 when the communicator is open and not aborted and no profiler runs (the Python path opens
 * its range), 0 otherwise, -1 on an error. */
static int lane_open(Lane *self) {
    int closed = truth_of(PyObject_GetAttr(self->comm, S_CLOSED));
    if (closed != 0)
        return closed < 0 ? -1 : 0;
    PyObject *broken = PyObject_GetAttr(self->comm, S_BROKEN);
    if (!broken)
        return -1;
    int ok = broken == Py_None;
    Py_DECREF(broken);
    if (!ok)
        return 0;
    int profiling = truth_of(PyObject_GetAttr(self->profiler, S_ENABLED));
    return profiling < 0 ? -1 : !profiling;
}

/* 1 when no rejection of ours by `peer` waits to be raised (Mailboxes.check_rejects), 0 when
 * one does (the Python path raises it), -1 on an error. */
static int lane_no_rejects(Lane *self, int peer) {
    const Py_ssize_t *idx = self->core->p2p_idx + 4 * peer;
    uint64_t count = __atomic_load_n(&self->core->words[idx[1] + 2], __ATOMIC_RELAXED);
    unsigned long long seen = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(self->rejects_seen, peer));
    if (seen == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    return count == seen;
}

static int lane_lock(PyObject *method) {
    PyObject *result = PyObject_CallNoArgs(method);
    Py_XDECREF(result);
    return result ? 0 : -1;
}

/* Adds `add` to dict[key] (absent: 0). */
static int lane_count(PyObject *dict, PyObject *key, Py_ssize_t add) {
    PyObject *old = PyDict_GetItemWithError(dict, key); /* borrowed */
    if (!old && PyErr_Occurred())
        return -1;
    long long value = old ? PyLong_AsLongLong(old) : 0;
    if (value == -1 && PyErr_Occurred())
        return -1;
    PyObject *now = PyLong_FromLongLong(value + add);
    if (!now)
        return -1;
    int status = PyDict_SetItem(dict, key, now);
    Py_DECREF(now);
    return status;
}

static int set_slot(PyObject *list, Py_ssize_t i, PyObject *value) {
    if (!value)
        return -1;
    return PyList_SetItem(list, i, value); /* steals value */
}

/* The object `ref` (a weak reference, or anything else: none) refers to, borrowed. */
static PyObject *referent(PyObject *ref) {
    if (!PyWeakref_CheckRef(ref))
        return NULL;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj = NULL;
    if (PyWeakref_GetRef(ref, &obj) < 0) {
        PyErr_Clear();
        return NULL;
    }
    Py_XDECREF(obj); /* the recorder's tuple still holds the reference */
    return obj;
#else
    PyObject *obj = PyWeakref_GetObject(ref);
    return obj == Py_None ? NULL : obj;
#endif
}

/* The record's (dtype, numel) of `tensor` (a new reference), through the recorder's two
 * remembered tensors as FlightRecorder.issue reads them. */
static PyObject *lane_shape(Lane *self, PyObject *tensor, PyObject *dtype) {
    PyObject *rec = self->recorder, *shape = NULL;
    PyObject *last = PyObject_GetAttr(rec, S_LAST);
    if (!last)
        return NULL;
    if (PyTuple_Check(last) && PyTuple_GET_SIZE(last) == 2 &&
        referent(PyTuple_GET_ITEM(last, 0)) == tensor) {
        shape = Py_NewRef(PyTuple_GET_ITEM(last, 1));
        Py_DECREF(last);
        return shape;
    }
    PyObject *prev = PyObject_GetAttr(rec, S_PREV);
    if (!prev) {
        Py_DECREF(last);
        return NULL;
    }
    PyObject *remembered = NULL;
    if (PyTuple_Check(prev) && PyTuple_GET_SIZE(prev) == 2 &&
        referent(PyTuple_GET_ITEM(prev, 0)) == tensor) {
        shape = Py_NewRef(PyTuple_GET_ITEM(prev, 1));
        remembered = Py_NewRef(prev);
    } else {
        PyObject *numel = PyObject_CallMethodNoArgs(tensor, S_NUMEL);
        shape = numel ? PyTuple_Pack(2, dtype, numel) : NULL;
        Py_XDECREF(numel);
        PyObject *ref = shape ? PyWeakref_NewRef(tensor, NULL) : NULL;
        remembered = ref ? PyTuple_Pack(2, ref, shape) : NULL;
        Py_XDECREF(ref);
    }
    if (!remembered || PyObject_SetAttr(rec, S_LAST, remembered) < 0 ||
        PyObject_SetAttr(rec, S_PREV, last) < 0)
        Py_CLEAR(shape);
    Py_XDECREF(remembered);
    Py_DECREF(prev);
    Py_DECREF(last);
    return shape;
}

/* Writes the completed call `op` (its tensor's shape, the peer) in the recorder's next slot;
 * a timed sequence number keeps `t0` and now. */
static int lane_record(Lane *self, PyObject *op, PyObject *tensor, PyObject *dtype, int peer,
                       int64_t t0) {
    PyObject *rec = self->recorder;
    PyObject *shape = lane_shape(self, tensor, dtype);
    if (!shape)
        return -1;
    PyObject *seq_obj = PyObject_GetAttr(rec, S_SEQ);
    long long seq = seq_obj ? PyLong_AsLongLong(seq_obj) : -1;
    Py_XDECREF(seq_obj);
    if (seq == -1 && PyErr_Occurred()) {
        Py_DECREF(shape);
        return -1;
    }
    seq += 1;
    PyObject *next = PyLong_FromLongLong(seq);
    if (!next || PyObject_SetAttr(rec, S_SEQ, next) < 0) {
        Py_XDECREF(next);
        Py_DECREF(shape);
        return -1;
    }
    Py_DECREF(next);
    Py_ssize_t i = (Py_ssize_t)(seq % self->capacity);
    int timed = !(seq & self->sample_mask);
    if (set_slot(self->rec_op, i, Py_NewRef(op)) < 0 || set_slot(self->rec_arg, i, shape) < 0 ||
        set_slot(self->rec_extra, i, PyLong_FromLong(peer)) < 0 ||
        set_slot(self->rec_t0, i, PyLong_FromLongLong(timed ? t0 : 0)) < 0 ||
        (timed && set_slot(self->rec_t1, i, PyLong_FromLongLong(now_ns())) < 0))
        return -1;
    PyByteArray_AS_STRING(self->rec_state)[i] = (char)self->completed;
    return 0;
}

/* The finished handle of the call: one of the lane's two previous ones that nothing else
 * holds (a caller keeps the last handle of a loop into the next call; as c10d's group._done),
 * else a new one in the older one's place; its outputs are `tensors` (and `src` for a
 * receive). */
static PyObject *lane_handle(Lane *self, PyObject **kept, PyObject *type, PyObject *tensors,
                             int src) {
    PyObject *work = NULL;
    if (self->reuse) {
        if (kept[0] && Py_REFCNT(kept[0]) == 1)
            work = kept[0];
        else if (kept[1] && Py_REFCNT(kept[1]) == 1)
            work = kept[1];
    }
    if (!work) {
        work = PyObject_CallNoArgs(type);
        if (!work)
            return NULL;
        Py_XSETREF(kept[1], kept[0]);
        kept[0] = work;
    }
    if (PyObject_SetAttr(work, S_OUTPUTS, tensors) < 0)
        return NULL;
    if (src >= 0) {
        PyObject *rank = PyLong_FromLong(src);
        int status = rank ? PyObject_SetAttr(work, S_SRC, rank) : -1;
        Py_XDECREF(rank);
        if (status < 0)
            return NULL;
    }
    return Py_NewRef(work);
}

/* Whether nothing is queued or posted that the usual call to or from `peer` would overtake
 * (the engine's send_now and recv_now tests, the lock held): 1, 0 or -1 on an error. */
static int lane_quiet(Lane *self, int sending, int peer) {
    if (sending) {
        Py_ssize_t queued = PyObject_Length(PyList_GET_ITEM(self->sends, peer));
        return queued < 0 ? -1 : queued == 0;
    }
    if (PyList_GET_ITEM(self->incoming, peer) != Py_None)
        return 0;
    Py_ssize_t stashed = PyObject_Length(PyList_GET_ITEM(self->stash, peer));
    if (stashed != 0)
        return stashed < 0 ? -1 : 0;
    int any = truth_of(PyObject_GetAttr(self->engine, S_WANTED_ANY));
    if (any != 0)
        return any < 0 ? -1 : 0;
    int named = PyObject_IsTrue(PyList_GET_ITEM(self->wanted, peer));
    return named < 0 ? -1 : !named;
}

/* The chunk under the engine's lock: DONE (the pair's counter moved on), a wait status after
 * the spin budget, -2 when the pair is not quiet, -1 on an error. */
static int lane_move(Lane *self, int sending, Chunk *c) {
    PyObject *counters = sending ? self->sent : self->received;
    if (lane_lock(self->acquire) < 0)
        return -1;
    int status = lane_quiet(self, sending, c->peer);
    if (status == 1) {
        c->k = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(counters, c->peer));
        status = PyErr_Occurred() ? -1 : DONE;
    } else if (status == 0) {
        status = -2;
    }
    if (status == DONE) {
        c->spin_ns = 0;
        status = sending ? chunk_send(self->core, c) : chunk_recv(self->core, c);
        if (status == (sending ? SLOT_WAIT : MESSAGE_WAIT)) {
            PyObject *budget = PyObject_CallNoArgs(self->spin_budget);
            long long spin = budget ? PyLong_AsLongLong(budget) : -1;
            Py_XDECREF(budget);
            if (spin == -1 && PyErr_Occurred())
                status = -1;
            else if (spin > 0) {
                c->spin_ns = spin > MAX_SPIN_NS ? MAX_SPIN_NS : spin;
                status = sending ? chunk_send(self->core, c) : chunk_recv(self->core, c);
            }
        }
        if (status == DONE &&
            set_slot(counters, c->peer, PyLong_FromUnsignedLongLong(c->k + 1)) < 0)
            status = -1;
    }
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    int released = lane_lock(self->release);
    if (type)
        PyErr_Restore(type, value, trace);
    return released < 0 ? -1 : status;
}

/* send and recv: (tensors, peer, tag) as the group's send and recv take them. */
static PyObject *lane_call(Lane *self, int sending, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "Lane.%s takes 3 arguments, got %zd",
                     sending ? "send" : "recv", nargs);
        return NULL;
    }
    Chunk c;
    int overflow;
    if (!lane_peer(self, args[1], &c.peer) || !PyLong_CheckExact(args[2]))
        Py_RETURN_NONE;
    long long tag = PyLong_AsLongLongAndOverflow(args[2], &overflow);
    if (overflow)
        Py_RETURN_NONE;
    int ok = lane_open(self);
    if (ok > 0)
        ok = lane_no_rejects(self, c.peer);
    PyObject *dtype = NULL;
    Py_ssize_t nbytes = 0;
    if (ok > 0)
        ok = lane_tensor(self, args[0], &c.user, &nbytes, &c.dtype, &dtype);
    if (ok <= 0) {
        if (ok < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    c.nbytes = (size_t)nbytes;
    c.total = (uint64_t)nbytes;
    c.tag = (uint64_t)tag;
    int64_t t0 = self->capacity ? now_ns() : 0;
    int status = lane_move(self, sending, &c);
    if (status != DONE) {
        Py_DECREF(dtype);
        if (status == -1)
            return NULL;
        if (status == -2)
            Py_RETURN_NONE;
        Py_RETURN_FALSE;
    }
    PyObject *tensor = PyList_GET_ITEM(args[0], 0);
    PyObject *op = sending ? S_SEND : S_RECV;
    PyObject *result = NULL;
    if (lane_count(self->calls, op, 1) < 0 ||
        (sending && lane_count(self->bytes, op, nbytes) < 0) ||
        (self->capacity && lane_record(self, op, tensor, dtype, c.peer, t0) < 0))
        goto done;
    if (sending) {
        result = lane_handle(self, self->done_kept, self->done_type, args[0], -1);
    } else {
        PyObject *versioned = PyTuple_Pack(1, tensor); /* written behind autograd's back */
        PyObject *bumped = versioned ? PyObject_CallOneArg(self->increment_version, versioned)
                                     : NULL;
        Py_XDECREF(versioned);
        if (bumped) {
            Py_DECREF(bumped);
            result = lane_handle(self, self->received_kept, self->received_type, args[0],
                                 c.peer);
        }
    }
done:
    Py_DECREF(dtype);
    return result;
}

static PyObject *Lane_send(Lane *self, PyObject *const *args, Py_ssize_t nargs) {
    return lane_call(self, 1, args, nargs);
}

static PyObject *Lane_recv(Lane *self, PyObject *const *args, Py_ssize_t nargs) {
    return lane_call(self, 0, args, nargs);
}

#define LANE_DOC                                                                              \
    "(tensors, peer, tag) -> the finished handle; None: not the usual call, nothing done (the " \
    "Python path takes it); False: the peer was not ready within the spin budget, nothing "    \
    "done (the Python path queues it without trying again)."

static PyMethodDef Lane_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Lane_send, METH_FASTCALL, "send" LANE_DOC},
    {"recv", (PyCFunction)(void (*)(void))Lane_recv, METH_FASTCALL, "recv" LANE_DOC},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fastcomm.comm.shm._core.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_dealloc = (destructor)Lane_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The torch backend's usual send and recv over one engine (module source).",
    .tp_methods = Lane_methods,
    .tp_traverse = (traverseproc)Lane_traverse,
    .tp_clear = (inquiry)Lane_clear,
    .tp_init = (initproc)Lane_init,
    .tp_new = PyType_GenericNew,
};

static PyMethodDef module_methods[] = {
    {"reduce", py_reduce, METH_VARARGS,
     "reduce(out, terms, numel, kind, op, scale=1.0, outs=()): out = terms[0] op terms[1] ... "
     "in order (each term times scale first, when scale != 1; AVG divides by len(terms)). out "
     "may alias terms[0] or terms[1], no later term. The result is also copied into every "
     "address of outs, chunk by chunk after every term of the chunk was read: each of outs is "
     "a term's address or overlaps no term, out nor another of outs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_core",
    .m_doc = "Compiled core of the shm communicator.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__core(void) {
    if (PyType_Ready(&SmallCoreType) < 0 || PyType_Ready(&LaneType) < 0 || intern_names() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&SmallCoreType);
    if (PyModule_AddObject(m, "SmallCore", (PyObject *)&SmallCoreType) < 0) {
        Py_DECREF(&SmallCoreType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Lane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    static const char *names[] = {"KIND_F32", "KIND_F64", "KIND_I8", "KIND_U8", "KIND_I32",
                                  "KIND_I64", "OP_SUM", "OP_PRODUCT", "OP_AVG", "DONE",
                                  "ENTER_WAIT", "EXCHANGE_WAIT", "MISMATCH", "MAX_TERMS",
                                  "MAX_SPIN_NS", "SLOT_WAIT", "MESSAGE_WAIT", "SIZE_MISMATCH",
                                  "MBOX_HEADER", "TAG_OTHER"};
    static const long long values[] = {K_F32, K_F64, K_I8, K_U8, K_I32, K_I64, OP_SUM,
                                       OP_PRODUCT, OP_AVG, DONE, ENTER_WAIT, EXCHANGE_WAIT,
                                       MISMATCH, MAX_TERMS, MAX_SPIN_NS, SLOT_WAIT,
                                       MESSAGE_WAIT, SIZE_MISMATCH, MBOX_HEADER, TAG_OTHER};
    for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
        PyObject *value = PyLong_FromLongLong(values[i]);
        int failed = !value || PyModule_AddObjectRef(m, names[i], value) < 0;
        Py_XDECREF(value);
        if (failed) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
