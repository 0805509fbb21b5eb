/* Compiled core of the shm communicator: the small one-shot all-reduce and the reductions.
 *
 * Python sequences the shm protocol (flags.py, schedules.py); at a few KiB its own per-call
 * cost (a dozen attribute loads, word reads through a memoryview, a NumPy or torch call per
 * step) is the whole time of an all-reduce. This module runs the same protocol, on the same
 * words, in C: wait until the half is free, record the descriptor, copy in, publish, wait for
 * every peer, check their descriptors, reduce in rank order. Every wait here only spins for a
 * bounded time; when a peer is not there yet it returns a status and Python finishes the wait
 * (yield, futex sleep, timeouts, liveness, aborts) with its own code, then calls back to resume.
 * Ranks with and without this module interoperate: the words and their order are the same.
 *
 * Memory ordering: flags are loaded with acquire and stored with release semantics, so data
 * stores before a publish are visible to a peer that sees the flag, on every architecture.
 *
 * Arithmetic: elementwise in the buffers' dtype, one operation per term in rank order, no
 * contraction into FMAs (built with -ffp-contract=off): the bits of torch's add/mul. Integer
 * types wrap (computed unsigned).
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

static const size_t KIND_SIZE[K_COUNT] = {4, 8, 1, 1, 4, 8};
/* Below this many bytes of input, a reduction keeps the GIL (releasing costs more). */
#define NOGIL_BYTES (256 * 1024)

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

#define DIVIDE_LOOP(T)                                                              \
    do {                                                                            \
        T *o = (T *)out;                                                            \
        const T d = (T)count;                                                       \
        for (size_t i = 0; i < n; i++)                                              \
            o[i] = o[i] / d;                                                        \
    } while (0)

/* out /= count, as torch's div_ (floats) or div_(rounding_mode="trunc") (integers: C's
 * signed division truncates toward zero too). */
static void divide(void *out, size_t n, int kind, int count) {
    switch (kind) {
    case K_F32: DIVIDE_LOOP(float); break;
    case K_F64: DIVIDE_LOOP(double); break;
    case K_I8: DIVIDE_LOOP(int8_t); break;
    case K_U8: DIVIDE_LOOP(uint8_t); break;
    case K_I32: DIVIDE_LOOP(int32_t); break;
    case K_I64: DIVIDE_LOOP(int64_t); break;
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

static int parse_kind_op(int kind, int op, double scale) {
    if (kind < 0 || kind >= K_COUNT) {
        PyErr_Format(PyExc_ValueError, "kind must be in [0, %d), got %d", K_COUNT, kind);
        return -1;
    }
    if (op < 0 || op >= OP_COUNT) {
        PyErr_Format(PyExc_ValueError, "op must be in [0, %d), got %d", OP_COUNT, op);
        return -1;
    }
    if (scale != 1.0 && (op != OP_SUM || (kind != K_F32 && kind != K_F64))) {
        PyErr_Format(PyExc_ValueError,
                     "a scale (got %g) needs op SUM on float32/float64, got kind %d op %d",
                     scale, kind, op);
        return -1;
    }
    return 0;
}

/* reduce(out, terms, numel, kind, op, scale=1.0): module docstring of reduce_terms. */
static PyObject *py_reduce(PyObject *self, PyObject *args) {
    unsigned long long out;
    PyObject *seq;
    Py_ssize_t numel;
    int kind, op;
    double scale = 1.0;
    (void)self;
    if (!PyArg_ParseTuple(args, "KOnii|d", &out, &seq, &numel, &kind, &op, &scale))
        return NULL;
    if (parse_kind_op(kind, op, scale) < 0)
        return NULL;
    if (numel < 0) {
        PyErr_Format(PyExc_ValueError, "numel must be >= 0, got %zd", numel);
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "terms must be a sequence of addresses");
    if (!fast)
        return NULL;
    Py_ssize_t nterms = PySequence_Fast_GET_SIZE(fast);
    if (nterms < 1 || nterms > 4096) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "terms must hold 1 to 4096 addresses, got %zd", nterms);
        return NULL;
    }
    char **terms = PyMem_Malloc(sizeof(char *) * (size_t)nterms);
    if (!terms) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t t = 0; t < nterms; t++) {
        unsigned long long addr = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, t));
        if (PyErr_Occurred()) {
            PyMem_Free(terms);
            Py_DECREF(fast);
            return NULL;
        }
        terms[t] = (char *)(uintptr_t)addr;
    }
    Py_DECREF(fast);
    size_t n = (size_t)numel;
    if (n) {
        int release = n * KIND_SIZE[kind] >= NOGIL_BYTES;
        PyThreadState *state = release ? PyEval_SaveThread() : NULL;
        if (nterms == 1) {
            if (scale != 1.0) { /* one term: out = term * scale */
                if (kind == K_F32) {
                    float *o = (float *)(uintptr_t)out;
                    const float *a = (const float *)terms[0], s = (float)scale;
                    for (size_t i = 0; i < n; i++)
                        o[i] = a[i] * s;
                } else {
                    double *o = (double *)(uintptr_t)out;
                    const double *a = (const double *)terms[0];
                    for (size_t i = 0; i < n; i++)
                        o[i] = a[i] * scale;
                }
            } else if ((char *)(uintptr_t)out != terms[0]) {
                memmove((void *)(uintptr_t)out, terms[0], n * KIND_SIZE[kind]);
            }
        } else {
            reduce_terms((void *)(uintptr_t)out, terms, (int)nterms, n, kind, op, scale);
        }
        if (release)
            PyEval_RestoreThread(state);
    }
    PyMem_Free(terms);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------- the small all-reduce */

typedef struct {
    PyObject_HEAD
    uint64_t *words;
    int rank, size;
    Py_ssize_t *seq_idx;  /* [size] */
    Py_ssize_t *wait_idx; /* [size] */
    Py_ssize_t *desc_idx; /* [size][2] */
    char **slots;         /* [2][size] */
} SmallCore;

static void SmallCore_dealloc(SmallCore *self) {
    PyMem_Free(self->seq_idx);
    PyMem_Free(self->wait_idx);
    PyMem_Free(self->desc_idx);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int read_indices(PyObject *seq, Py_ssize_t count, Py_ssize_t *out, const char *what) {
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
        out[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s: negative entry %zd", what, out[i]);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* SmallCore(base, rank, seq_idx, wait_idx, desc_idx, slots): `base` is the address of the
 * mapped segment (8-byte aligned); the index lists are in 8-byte words, per rank; `desc_idx`
 * lists the two halves' descriptor words of rank 0, then rank 1, ...; `slots` lists the slot
 * addresses of half 0 for every rank, then of half 1. The mapping must outlive the object. */
static int SmallCore_init(SmallCore *self, PyObject *args, PyObject *kwds) {
    unsigned long long base;
    int rank;
    PyObject *seq_idx, *wait_idx, *desc_idx, *slots;
    (void)kwds;
    if (!PyArg_ParseTuple(args, "KiOOOO", &base, &rank, &seq_idx, &wait_idx, &desc_idx, &slots))
        return -1;
    if (base == 0 || base % 8) {
        PyErr_Format(PyExc_ValueError, "base must be a nonzero 8-byte aligned address, got %llu",
                     base);
        return -1;
    }
    Py_ssize_t size = PySequence_Size(seq_idx);
    if (size < 1 || size > 65536) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "seq_idx must list 1 to 65536 ranks, got %zd", size);
        return -1;
    }
    if (rank < 0 || rank >= size) {
        PyErr_Format(PyExc_ValueError, "rank must be in [0, %zd), got %d", size, rank);
        return -1;
    }
    self->words = (uint64_t *)(uintptr_t)base;
    self->rank = rank;
    self->size = (int)size;
    self->seq_idx = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)size);
    self->wait_idx = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)size);
    self->desc_idx = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * (size_t)size);
    Py_ssize_t *addr = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * (size_t)size);
    self->slots = PyMem_Malloc(sizeof(char *) * 2 * (size_t)size);
    if (!self->seq_idx || !self->wait_idx || !self->desc_idx || !addr || !self->slots) {
        PyMem_Free(addr);
        PyErr_NoMemory();
        return -1;
    }
    if (read_indices(seq_idx, size, self->seq_idx, "seq_idx") < 0 ||
        read_indices(wait_idx, size, self->wait_idx, "wait_idx") < 0 ||
        read_indices(desc_idx, 2 * size, self->desc_idx, "desc_idx") < 0 ||
        read_indices(slots, 2 * size, addr, "slots") < 0) {
        PyMem_Free(addr);
        return -1;
    }
    for (Py_ssize_t i = 0; i < 2 * size; i++)
        self->slots[i] = (char *)(uintptr_t)addr[i];
    PyMem_Free(addr);
    return 0;
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

/* all_reduce(user, numel, kind, op, code, half, enter, target, stage, spin_ns) -> status.
 *
 * One call of the one-shot all-reduce of `numel` elements at address `user`, in place.
 * `enter`: the seq every peer must have reached before this rank rewrites `half` (the first
 * publish of the previous round); `target`: the seq this call publishes (this rank's + 1).
 * `stage` resumes after Python finished a wait: 0 from the start, 1 after the enter wait,
 * 2 after the exchange wait. Returns DONE (0), ENTER_WAIT (1: nothing written yet),
 * EXCHANGE_WAIT (2: published, peers not all there) or MISMATCH (3: a peer's descriptor
 * differs; nothing reduced). */
static PyObject *SmallCore_all_reduce(SmallCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "all_reduce takes 10 arguments, got %zd", nargs);
        return NULL;
    }
    unsigned long long user = PyLong_AsUnsignedLongLong(args[0]);
    Py_ssize_t numel = PyLong_AsSsize_t(args[1]);
    long kind = PyLong_AsLong(args[2]);
    long op = PyLong_AsLong(args[3]);
    unsigned long long code = PyLong_AsUnsignedLongLong(args[4]);
    long half = PyLong_AsLong(args[5]);
    unsigned long long enter = PyLong_AsUnsignedLongLong(args[6]);
    unsigned long long target = PyLong_AsUnsignedLongLong(args[7]);
    long stage = PyLong_AsLong(args[8]);
    long long spin_ns = PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred())
        return NULL;
    if (parse_kind_op((int)kind, (int)op, 1.0) < 0)
        return NULL;
    if (numel < 0 || (half != 0 && half != 1) || stage < 0 || stage > 2) {
        PyErr_Format(PyExc_ValueError, "bad all_reduce call: numel %zd, half %ld, stage %ld",
                     numel, half, stage);
        return NULL;
    }
    int rank = self->rank, size = self->size;
    char **slots = self->slots + half * size;
    uint64_t *words = self->words;
    if (stage == 0) {
        if (!peers_reached(self, enter, spin_ns))
            return PyLong_FromLong(ENTER_WAIT);
        stage = 1;
    }
    if (stage == 1) {
        size_t nbytes = (size_t)numel * KIND_SIZE[kind];
        __atomic_store_n(&words[self->desc_idx[2 * rank + half]], code, __ATOMIC_RELAXED);
        memcpy(slots[rank], (const void *)(uintptr_t)user, nbytes);
        uint64_t *mine = &words[self->seq_idx[rank]];
        __atomic_store_n(mine, target, __ATOMIC_RELEASE);
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
        if (!peers_reached(self, target, spin_ns))
            return PyLong_FromLong(EXCHANGE_WAIT);
    }
    for (int p = 0; p < size; p++)
        if (p != rank && __atomic_load_n(&words[self->desc_idx[2 * p + half]],
                                         __ATOMIC_RELAXED) != code)
            return PyLong_FromLong(MISMATCH);
    if (size == 1)
        memcpy((void *)(uintptr_t)user, slots[0], (size_t)numel * KIND_SIZE[kind]);  /* AVG: /1 */
    else
        reduce_terms((void *)(uintptr_t)user, slots, size, (size_t)numel, (int)kind, (int)op,
                     1.0);
    return PyLong_FromLong(DONE);
}

static PyMethodDef SmallCore_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))SmallCore_all_reduce, METH_FASTCALL,
     "One-shot all-reduce of a small buffer; see the module source for the protocol."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SmallCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fastcomm.comm.shm._core.SmallCore",
    .tp_basicsize = sizeof(SmallCore),
    .tp_dealloc = (destructor)SmallCore_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The small one-shot all-reduce of one rank over a mapped shm segment.",
    .tp_methods = SmallCore_methods,
    .tp_init = (initproc)SmallCore_init,
    .tp_new = PyType_GenericNew,
};

static PyMethodDef module_methods[] = {
    {"reduce", py_reduce, METH_VARARGS,
     "reduce(out, terms, numel, kind, op, scale=1.0): out = terms[0] op terms[1] ... in order "
     "(each term times scale first, when scale != 1)."},
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
    if (PyType_Ready(&SmallCoreType) < 0)
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
    static const char *names[] = {"KIND_F32", "KIND_F64", "KIND_I8", "KIND_U8", "KIND_I32",
                                  "KIND_I64", "OP_SUM", "OP_PRODUCT", "OP_AVG", "DONE", "ENTER_WAIT",
                                  "EXCHANGE_WAIT", "MISMATCH"};
    static const long values[] = {K_F32, K_F64, K_I8, K_U8, K_I32, K_I64, OP_SUM, OP_PRODUCT, OP_AVG,
                                  DONE, ENTER_WAIT, EXCHANGE_WAIT, MISMATCH};
    for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
        if (PyModule_AddIntConstant(m, names[i], values[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
