/* One fused pass over a float tensor on the CPU: the eight raw sums of probes.stats, read once.
 *
 * The torch path takes five or six vectorised passes per tensor (sum, min, max, a dot for the squares,
 * one for the non-zeros) and as many calls into the dispatcher; for the small tensors of a sampled step
 * the calls cost more than the arithmetic. This reads each element once, masks NaN/Inf in the same pass
 * (so a tensor with a NaN costs no more than one without), and releases the GIL while it reads.
 *
 * Sums are accumulated in float within blocks of BLOCK elements (split across the SIMD lanes) and the
 * block totals in double: closer to a float64 sum than torch's float32 sum and dot.
 *
 * Built by setup.py when a C compiler is there (optional: without one the probe keeps its torch path).
 * target_clones picks an AVX-512, AVX2 or baseline body for the CPU at load time, so a wheel built on
 * one machine runs on any x86-64 one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#define BLOCK 2048

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* out: sum, sum of squares, NaN count, Inf count, zero count, min, max (over the finite elements), n */
#define STATS_BODY(T)                                                                                     \
    double sum = 0.0, sumsq = 0.0, nan = 0.0, inf = 0.0, zero = 0.0;                                      \
    T lo = (T)INFINITY, hi = (T)-INFINITY;                                                                \
    for (Py_ssize_t b = 0; b < n; b += BLOCK) {                                                           \
        const Py_ssize_t m = n - b < BLOCK ? n - b : BLOCK;                                               \
        const T *p = x + b;                                                                               \
        T s = 0, ss = 0, blo = (T)INFINITY, bhi = (T)-INFINITY;                                           \
        int bad = 0, z = 0;                                                                               \
        _Pragma("omp simd reduction(+ : s, ss, bad, z) reduction(min : blo) reduction(max : bhi)")        \
        for (Py_ssize_t i = 0; i < m; i++) {                                                              \
            const T v = p[i];                                                                             \
            const int nf = !((v - v) == (T)0); /* NaN or +-Inf */                                         \
            const T f = nf ? (T)0 : v;                                                                    \
            const T l = nf ? (T)INFINITY : v, h = nf ? (T)-INFINITY : v;                                  \
            s += f;                                                                                       \
            ss += f * f;                                                                                  \
            bad += nf;                                                                                    \
            z += v == (T)0;                                                                               \
            blo = l < blo ? l : blo;                                                                      \
            bhi = h > bhi ? h : bhi;                                                                      \
        }                                                                                                 \
        if (bad) { /* rare: tell NaN from Inf */                                                          \
            for (Py_ssize_t i = 0; i < m; i++) {                                                          \
                if (isnan(p[i])) nan += 1.0;                                                              \
                else if (isinf(p[i])) inf += 1.0;                                                         \
            }                                                                                             \
        }                                                                                                 \
        sum += s;                                                                                         \
        sumsq += ss;                                                                                      \
        zero += z;                                                                                        \
        lo = blo < lo ? blo : lo;                                                                         \
        hi = bhi > hi ? bhi : hi;                                                                         \
    }                                                                                                     \
    out[0] = sum; out[1] = sumsq; out[2] = nan; out[3] = inf; out[4] = zero;                              \
    out[5] = (double)lo; out[6] = (double)hi; out[7] = (double)n;

CLONES static void stats_f32(const float *x, Py_ssize_t n, double *out) { STATS_BODY(float) }

CLONES static void stats_f64(const double *x, Py_ssize_t n, double *out) { STATS_BODY(double) }

static PyObject *
fastats_stats(PyObject *Py_UNUSED(self), PyObject *args)
{
    unsigned long long ptr;
    Py_ssize_t n;
    int is_double;
    if (!PyArg_ParseTuple(args, "Knp", &ptr, &n, &is_double))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "numel must be >= 0");
        return NULL;
    }
    if (ptr == 0 && n > 0) {
        PyErr_SetString(PyExc_ValueError, "null data pointer");
        return NULL;
    }
    double out[8];
    Py_BEGIN_ALLOW_THREADS
    if (is_double)
        stats_f64((const double *)(uintptr_t)ptr, n, out);
    else
        stats_f32((const float *)(uintptr_t)ptr, n, out);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("[dddddddd]", out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7]);
}

/* Sums of squares for the update ratio: of src while copying it to dst (the weights before the step),
 * and of a - b (the step's update), one pass each. */
#define SQUARES_BODY(T, EXPR, STORE)                                                                      \
    double total = 0.0;                                                                                   \
    for (Py_ssize_t b = 0; b < n; b += BLOCK) {                                                           \
        const Py_ssize_t m = n - b < BLOCK ? n - b : BLOCK;                                               \
        T ss = 0;                                                                                         \
        _Pragma("omp simd reduction(+ : ss)")                                                             \
        for (Py_ssize_t i = b; i < b + m; i++) {                                                          \
            const T v = EXPR;                                                                             \
            STORE;                                                                                        \
            ss += v * v;                                                                                  \
        }                                                                                                 \
        total += ss;                                                                                      \
    }                                                                                                     \
    return total;

CLONES static double copy_f32(float *restrict dst, const float *restrict x, Py_ssize_t n) {
    SQUARES_BODY(float, x[i], dst[i] = v) }
CLONES static double copy_f64(double *restrict dst, const double *restrict x, Py_ssize_t n) {
    SQUARES_BODY(double, x[i], dst[i] = v) }
CLONES static double diff_f32(const float *restrict x, const float *restrict y, Py_ssize_t n) {
    SQUARES_BODY(float, x[i] - y[i], (void)0) }
CLONES static double diff_f64(const double *restrict x, const double *restrict y, Py_ssize_t n) {
    SQUARES_BODY(double, x[i] - y[i], (void)0) }

static PyObject *
squares(PyObject *args, int copy)
{
    unsigned long long a, b;
    Py_ssize_t n;
    int is_double;
    if (!PyArg_ParseTuple(args, "KKnp", &a, &b, &n, &is_double))
        return NULL;
    if (n < 0 || ((a == 0 || b == 0) && n > 0)) {
        PyErr_SetString(PyExc_ValueError, "numel must be >= 0 and the data pointers not null");
        return NULL;
    }
    double total;
    Py_BEGIN_ALLOW_THREADS
    if (copy)
        total = is_double ? copy_f64((double *)(uintptr_t)a, (const double *)(uintptr_t)b, n)
                          : copy_f32((float *)(uintptr_t)a, (const float *)(uintptr_t)b, n);
    else
        total = is_double ? diff_f64((const double *)(uintptr_t)a, (const double *)(uintptr_t)b, n)
                          : diff_f32((const float *)(uintptr_t)a, (const float *)(uintptr_t)b, n);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(total);
}

static PyObject *fastats_copy_sumsq(PyObject *Py_UNUSED(self), PyObject *args) { return squares(args, 1); }

static PyObject *fastats_diff_sumsq(PyObject *Py_UNUSED(self), PyObject *args) { return squares(args, 0); }

/* Units of a ReLU-family output seen as (outer, units, inner), contiguous: how many are > 0 somewhere. */
#define ALIVE_BODY(T)                                                                                     \
    for (Py_ssize_t o = 0; o < outer; o++) {                                                              \
        const T *row = x + o * units * inner;                                                             \
        if (inner == 1) {                                                                                 \
            _Pragma("omp simd")                                                                           \
            for (Py_ssize_t u = 0; u < units; u++)                                                        \
                alive[u] |= row[u] > (T)0;                                                                \
        } else {                                                                                          \
            for (Py_ssize_t u = 0; u < units; u++) {                                                      \
                const T *q = row + u * inner;                                                             \
                unsigned char a = 0;                                                                      \
                _Pragma("omp simd reduction(| : a)")                                                      \
                for (Py_ssize_t i = 0; i < inner; i++)                                                    \
                    a |= q[i] > (T)0;                                                                     \
                alive[u] |= a;                                                                            \
            }                                                                                             \
        }                                                                                                 \
    }

CLONES static void alive_f32(const float *x, Py_ssize_t outer, Py_ssize_t units, Py_ssize_t inner,
                             unsigned char *alive) { ALIVE_BODY(float) }

CLONES static void alive_f64(const double *x, Py_ssize_t outer, Py_ssize_t units, Py_ssize_t inner,
                             unsigned char *alive) { ALIVE_BODY(double) }

static PyObject *
fastats_alive(PyObject *Py_UNUSED(self), PyObject *args)
{
    unsigned long long ptr;
    Py_ssize_t outer, units, inner;
    int is_double;
    if (!PyArg_ParseTuple(args, "Knnnp", &ptr, &outer, &units, &inner, &is_double))
        return NULL;
    if (outer < 0 || units < 0 || inner < 0) {
        PyErr_SetString(PyExc_ValueError, "shape must be >= 0");
        return NULL;
    }
    if (ptr == 0 && outer * units * inner > 0) {
        PyErr_SetString(PyExc_ValueError, "null data pointer");
        return NULL;
    }
    unsigned char *alive = PyMem_Calloc(units ? units : 1, 1);
    if (alive == NULL)
        return PyErr_NoMemory();
    Py_ssize_t count = 0;
    Py_BEGIN_ALLOW_THREADS
    if (is_double)
        alive_f64((const double *)(uintptr_t)ptr, outer, units, inner, alive);
    else
        alive_f32((const float *)(uintptr_t)ptr, outer, units, inner, alive);
    for (Py_ssize_t u = 0; u < units; u++)
        count += alive[u];
    Py_END_ALLOW_THREADS
    PyMem_Free(alive);
    return PyLong_FromSsize_t(count);
}

static PyMethodDef methods[] = {
    {"stats", fastats_stats, METH_VARARGS,
     "stats(data_ptr, numel, is_double) -> [sum, sumsq, nan, inf, zero, min, max, n]\n\n"
     "One pass over a contiguous float32 (or float64) buffer that the caller keeps alive. Moments, min\n"
     "and max are over the finite elements."},
    {"copy_sumsq", fastats_copy_sumsq, METH_VARARGS,
     "copy_sumsq(dst_ptr, src_ptr, numel, is_double) -> float\n\n"
     "Copy src to dst (contiguous, same dtype, not overlapping) and return src's sum of squares."},
    {"diff_sumsq", fastats_diff_sumsq, METH_VARARGS,
     "diff_sumsq(a_ptr, b_ptr, numel, is_double) -> float\n\nThe sum of squares of a - b."},
    {"alive", fastats_alive, METH_VARARGS,
     "alive(data_ptr, outer, units, inner, is_double) -> int\n\n"
     "How many units of a contiguous (outer, units, inner) buffer are > 0 somewhere: a ReLU unit\n"
     "that is not is dead across the batch."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_fastats",
    .m_doc = "The probe's fused CPU passes (see probes/stats.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__fastats(void)
{
    return PyModule_Create(&module);
}
