/* The probe's native CPU passes (probes/stats.py, probes/collect.py, probes/embeddings/).
 *
 * - stats: the eight raw sums of a tensor (sum, sum of squares, NaN/Inf/zero counts, min and max over the
 *   finite elements), each element read once, NaN/Inf masked in the same pass. The torch path takes five
 *   or six vectorised passes per tensor and as many dispatcher calls and host reads; for the small
 *   tensors of a sampled step the calls cost more than the arithmetic.
 * - copy_sumsq / diff_sumsq: the update ratio's two norms, one while copying the weights before the
 *   optimizer step, one over the difference after it.
 * - outside / alive: a bounded activation's saturated elements, a ReLU output's live units.
 * - track_pre / track_post: one tracked step of an embedding table (see below); report_rows: the lists,
 *   counts and collapse statistics of its report.
 *
 * Sums are accumulated in float within blocks of BLOCK elements (split across the SIMD lanes) and the
 * block totals in double: closer to a float64 sum than torch's float32 sum and dot. Every entry point
 * releases the GIL while it reads. Buffers are the caller's: contiguous, alive for the call, and of
 * the dtype it says.
 *
 * Built by setup.py when a C compiler is there (optional: without one the probe keeps its torch path).
 * target_clones picks an AVX-512, AVX2 or baseline body for the CPU at load time, so a wheel built on
 * one machine runs on any x86-64 one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* Elements of a bounded activation's output within a band of either bound: <= lo or >= hi. */
#define OUTSIDE_BODY(T)                                                                                   \
    Py_ssize_t count = 0;                                                                                 \
    _Pragma("omp simd reduction(+ : count)")                                                              \
    for (Py_ssize_t i = 0; i < n; i++)                                                                    \
        count += (x[i] <= (T)lo) | (x[i] >= (T)hi);                                                       \
    return count;

CLONES static Py_ssize_t outside_f32(const float *x, Py_ssize_t n, double lo, double hi) { OUTSIDE_BODY(float) }

CLONES static Py_ssize_t outside_f64(const double *x, Py_ssize_t n, double lo, double hi) { OUTSIDE_BODY(double) }

static PyObject *
fastats_outside(PyObject *Py_UNUSED(self), PyObject *args)
{
    unsigned long long ptr;
    Py_ssize_t n;
    double lo, hi;
    int is_double;
    if (!PyArg_ParseTuple(args, "Knddp", &ptr, &n, &lo, &hi, &is_double))
        return NULL;
    if (n < 0 || (ptr == 0 && n > 0)) {
        PyErr_SetString(PyExc_ValueError, "numel must be >= 0 and the data pointer not null");
        return NULL;
    }
    Py_ssize_t count;
    Py_BEGIN_ALLOW_THREADS
    count = is_double ? outside_f64((const double *)(uintptr_t)ptr, n, lo, hi)
                      : outside_f32((const float *)(uintptr_t)ptr, n, lo, hi);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(count);
}

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


/* ---- embedding rows: one tracked step, applied as it happens (probes/embeddings/native.py) ----
 *
 * The same recurrences as the fold (probes/embeddings/fold.py), which applies a queue of steps at once with
 * vectorised torch operations (a segmented scan); here each step updates its rows' statistics directly, in
 * the optimizer step's hooks: O(lookups x width) a step, no queue, no fold, no memory per row beyond the
 * state.
 * track_pre, before the optimizer step, finds the step's distinct rows (a hash table of 2x the lookups,
 * in the caller's scratch), counts their lookups, reduces their gradient rows to their largest |element|
 * and sketch, and copies their values; track_post, after it, reads the rows' new values and updates
 * their statistics.
 */

static inline double clean(double x) /* torch.nan_to_num(x, nan=0, posinf=0, neginf=0) */
{
    return isfinite(x) ? x : 0.0;
}

/* The slot of row ``id`` in this step's open-addressing table (``h`` entries, a power of two, keys -1
 * when free); a new row takes slot ``*nu`` when ``add``, else -1 is returned. */
static inline Py_ssize_t slot_of(int64_t id, int64_t *keys, int64_t *slots, Py_ssize_t h, Py_ssize_t *nu, int add)
{
    Py_ssize_t i = (Py_ssize_t)(((uint64_t)id * 0x9E3779B97F4A7C15ULL) >> 32) & (h - 1);
    while (keys[i] != -1) {
        if (keys[i] == id)
            return (Py_ssize_t)slots[i];
        i = (i + 1) & (h - 1);
    }
    if (!add)
        return -1;
    keys[i] = id;
    slots[i] = *nu;
    return (*nu)++;
}

/* Eight floats in one vector (GCC/clang vector extensions: one AVX register, or two SSE ones). Short rows
 * are summed with these explicitly: the auto-vectoriser's float reductions carry a costly epilogue per row,
 * or shuffle across the loop it should keep. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#pragma GCC diagnostic ignored "-Wpsabi" /* the baseline clone passes v8f in memory: static functions only */

static inline v8f load8(const float *p)
{
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum8(v8f v)
{
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* Pairwise sums of two vectors, interleaved: [x0+x1, x2+x3, y0+y1, y2+y3, x4+x5, x6+x7, y4+y5, y6+y7] (AVX's
 * hadd). Two levels of it sum four vectors at once: the sums of a row's statistics in a few shuffles,
 * instead of a horizontal sum each. */
static inline v8f hadd8(v8f x, v8f y)
{
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14)
           + __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* out[i] = the sum of the elements of the i-th of a, b, c, d */
static inline void sum4x8(v8f a, v8f b, v8f c, v8f d, float out[4])
{
    const v8f s = hadd8(hadd8(a, b), hadd8(c, d)); /* [a0-3, b0-3, c0-3, d0-3, a4-7, b4-7, c4-7, d4-7] */
    for (int i = 0; i < 4; i++)
        out[i] = s[i] + s[i + 4];
}

/* How many rows ahead the row loops prefetch: a large table's rows (and their state) are cache misses, which
 * the loop bodies are too long for the CPU to overlap by itself. */
#define AHEAD 8

static inline void prefetch_row(const float *p, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i += 16) /* a 64-byte line */
        __builtin_prefetch(p + i);
    __builtin_prefetch(p + n - 1);
}

/* The largest |element| of a row (NaN when it holds a NaN), from the bits: a float's magnitude orders as
 * its bits with the sign cleared, and a NaN's bits are above inf's. An integer max, which the compiler
 * vectorises without the float reduction's epilogue (rows are short: 1 to a few hundred elements). */
static inline float max_abs_row(const float *g, Py_ssize_t dim)
{
    uint32_t m = 0;
    for (Py_ssize_t d = 0; d < dim; d++) {
        uint32_t b;
        memcpy(&b, g + d, sizeof b);
        b &= 0x7fffffffu;
        m = b > m ? b : m;
    }
    if (m > 0x7f800000u)
        return NAN;
    float f;
    memcpy(&f, &m, sizeof f);
    return f;
}

/* Per distinct row of a step: the gradient row's largest |element| (NaN when it holds a NaN) and its
 * sketch (g @ proj, proj (dim, k); g itself when proj is NULL and k == dim), and a copy of the row. */
CLONES static void reduce_rows(Py_ssize_t nu, const int64_t *uniq, const float *grad, const float *acc,
                               const float *w, const float *proj, Py_ssize_t dim, Py_ssize_t k, float *gsk,
                               float *before)
{
    for (Py_ssize_t s = 0; s < nu; s++) {
        if (s + AHEAD < nu) { /* rows of a large table are cache misses: several in flight at once */
            prefetch_row(w + uniq[s + AHEAD] * dim, dim);
            if (grad != NULL)
                prefetch_row(grad + uniq[s + AHEAD] * dim, dim);
        }
        const float *g = grad != NULL ? grad + uniq[s] * dim : acc + s * dim;
        float *out = gsk + s * (k + 1);
        out[0] = max_abs_row(g, dim);
        if (proj == NULL) {
            for (Py_ssize_t d = 0; d < dim; d++)
                out[1 + d] = g[d];
        } else if (k == 8) { /* SKETCH_DIM: one vector of 8 per gradient element, in two independent sums */
            v8f o = {0}, e = {0};
            Py_ssize_t d = 0;
            for (; d + 2 <= dim; d += 2) {
                o += g[d] * load8(proj + d * 8);
                e += g[d + 1] * load8(proj + d * 8 + 8);
            }
            if (d < dim)
                o += g[d] * load8(proj + d * 8);
            o += e;
            memcpy(out + 1, &o, sizeof o);
        } else {
            for (Py_ssize_t j = 0; j < k; j++)
                out[1 + j] = 0.0f;
            for (Py_ssize_t d = 0; d < dim; d++) {
                const float gd = g[d];
                const float *pr = proj + d * k;
                for (Py_ssize_t j = 0; j < k; j++)
                    out[1 + j] += gd * pr[j];
            }
        }
        const float *src = w + uniq[s] * dim;
        float *dst = before + s * dim;
        for (Py_ssize_t d = 0; d < dim; d++)
            dst[d] = src[d];
    }
}

/* Adds ``n`` ids to the step's distinct rows (``uniq``, their counts ``cnt``), ``weight`` lookups each (1; 0
 * for a row of the step with no lookup here), padding rows skipped: the index of the first id out of the
 * table's rows, or -1. */
static Py_ssize_t add_rows(const int64_t *ids, Py_ssize_t n, float weight, Py_ssize_t rows, const int64_t *pad,
                           Py_ssize_t n_pad, int64_t *keys, int64_t *slots, Py_ssize_t h, int64_t *uniq, float *cnt,
                           Py_ssize_t *nu)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        if (id < 0 || id >= rows)
            return i;
        int is_pad = 0;
        for (Py_ssize_t p = 0; p < n_pad; p++)
            is_pad |= pad[p] == id;
        if (is_pad)
            continue;
        const Py_ssize_t before_nu = *nu, s = slot_of(id, keys, slots, h, nu, 1);
        if (*nu > before_nu) {
            uniq[s] = id;
            cnt[s] = weight;
        } else {
            cnt[s] += weight;
        }
    }
    return -1;
}

/* The rows of a dense float32 (rows, dim) gradient with an element that is not +-0 (NaN counts), in order:
 * a replicated table's rows of the step, whoever looked them up (see TableState.gather). One pass, the
 * elements' bits or-ed per row. */
CLONES static Py_ssize_t nonzero_rows(const uint32_t *g, Py_ssize_t rows, Py_ssize_t dim, int64_t *out)
{
    Py_ssize_t n = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const uint32_t *q = g + r * dim;
        uint32_t bits = 0;
#pragma omp simd reduction(| : bits)
        for (Py_ssize_t d = 0; d < dim; d++)
            bits |= q[d] & 0x7fffffffu;
        out[n] = r;
        n += bits != 0;
    }
    return n;
}

static PyObject *
fastats_nonzero_rows(PyObject *Py_UNUSED(self), PyObject *args)
{
    unsigned long long g_p, out_p;
    Py_ssize_t rows, dim;
    if (!PyArg_ParseTuple(args, "KnnK", &g_p, &rows, &dim, &out_p))
        return NULL;
    if (rows < 0 || dim <= 0 || (rows > 0 && (g_p == 0 || out_p == 0))) {
        PyErr_SetString(PyExc_ValueError, "nonzero_rows: bad arguments");
        return NULL;
    }
    Py_ssize_t n;
    Py_BEGIN_ALLOW_THREADS
    n = nonzero_rows((const uint32_t *)(uintptr_t)g_p, rows, dim, (int64_t *)(uintptr_t)out_p);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(n);
}

static PyObject *
fastats_track_pre(PyObject *Py_UNUSED(self), PyObject *args)
{
    unsigned long long ids_p, grad_p, gi_p, gv_p, src_uniq_p, src_cnt_p, w_p, proj_p, pad_p, keys_p, slots_p, uniq_p,
        cnt_p, gsk_p, before_p, acc_p, extra_p;
    Py_ssize_t n_ids, rows, dim, k, n_g, src_nu, n_pad, h, n_extra;
    /* what changes every step, then the table's fixed arguments, then the scratch, then the rows updated
     * without a lookup here (a replicated table's rows other ranks looked up: their gradient is reduced
     * into this rank's), each a row of the step with no lookup */
    if (!PyArg_ParseTuple(args, "KnKKKnKKnKnnnKKnKKnKKKKKKn", &ids_p, &n_ids, &grad_p, &gi_p, &gv_p, &n_g,
                          &src_uniq_p, &src_cnt_p, &src_nu, &w_p, &rows, &dim, &k, &proj_p, &pad_p, &n_pad, &keys_p,
                          &slots_p, &h, &uniq_p, &cnt_p, &gsk_p, &before_p, &acc_p, &extra_p, &n_extra))
        return NULL;
    const int64_t *extra = (const int64_t *)(uintptr_t)extra_p;
    const int64_t *ids = (const int64_t *)(uintptr_t)ids_p, *gi = (const int64_t *)(uintptr_t)gi_p;
    const int64_t *pad = (const int64_t *)(uintptr_t)pad_p;
    const float *grad = (const float *)(uintptr_t)grad_p, *gv = (const float *)(uintptr_t)gv_p;
    const float *w = (const float *)(uintptr_t)w_p, *proj = (const float *)(uintptr_t)proj_p;
    int64_t *keys = (int64_t *)(uintptr_t)keys_p, *slots = (int64_t *)(uintptr_t)slots_p;
    int64_t *uniq = (int64_t *)(uintptr_t)uniq_p;
    float *cnt = (float *)(uintptr_t)cnt_p, *gsk = (float *)(uintptr_t)gsk_p, *before = (float *)(uintptr_t)before_p;
    float *acc = (float *)(uintptr_t)acc_p;
    const int64_t *src_uniq = (const int64_t *)(uintptr_t)src_uniq_p;
    const float *src_cnt = (const float *)(uintptr_t)src_cnt_p;
    if (n_ids < 0 || dim <= 0 || k <= 0 || n_g < 0 || n_pad < 0 || n_extra < 0 || (n_extra > 0 && extra == NULL)
        || h < 2 * (n_ids + n_extra) || (h & (h - 1)) != 0
        || (proj == NULL && k != dim) || (grad == NULL && (gi == NULL || gv == NULL || acc == NULL) && n_g > 0)
        || (src_uniq != NULL && (grad == NULL || src_cnt == NULL || src_nu < 0 || src_nu > n_ids || n_extra > 0))) {
        PyErr_SetString(PyExc_ValueError, "track_pre: bad arguments");
        return NULL;
    }
    Py_ssize_t bad_id = -1, nu = 0;
    Py_BEGIN_ALLOW_THREADS
    if (src_uniq != NULL) { /* the same lookups as a table of as many rows and the same padding, just found:
                             * its distinct rows and counts, not another hash (dense gradients only: a sparse
                             * one's entries are matched through the hash table) */
        for (Py_ssize_t s = 0; s < src_nu; s++)
            if (src_uniq[s] < 0 || src_uniq[s] >= rows)
                bad_id = s;
        if (bad_id < 0) {
            memcpy(uniq, src_uniq, (size_t)src_nu * sizeof(int64_t));
            memcpy(cnt, src_cnt, (size_t)src_nu * sizeof(float));
            nu = src_nu;
        }
        n_ids = 0; /* the loop below has nothing left to find */
    } else {
        memset(keys, 0xff, (size_t)h * sizeof(int64_t)); /* every key -1 */
    }
    if (bad_id < 0)
        bad_id = add_rows(ids, n_ids, 1.0f, rows, pad, n_pad, keys, slots, h, uniq, cnt, &nu);
    if (bad_id < 0) { /* no lookup here: rows of the step, count 0 */
        bad_id = add_rows(extra, n_extra, 0.0f, rows, pad, n_pad, keys, slots, h, uniq, cnt, &nu);
        bad_id = bad_id < 0 ? -1 : n_ids + bad_id;
    }
    if (bad_id < 0) {
        if (grad == NULL) { /* sparse: a step's entries of one row add up; entries of rows not looked up drop */
            memset(acc, 0, (size_t)nu * (size_t)dim * sizeof(float));
            for (Py_ssize_t j = 0; j < n_g; j++) {
                const Py_ssize_t s = slot_of(gi[j], keys, slots, h, &nu, 0);
                if (s < 0)
                    continue;
                float *dst = acc + s * dim;
                const float *src = gv + j * dim;
                for (Py_ssize_t d = 0; d < dim; d++)
                    dst[d] += src[d];
            }
        }
        reduce_rows(nu, uniq, grad, acc, w, proj, dim, k, gsk, before);
    }
    Py_END_ALLOW_THREADS
    if (bad_id >= 0) {
        PyErr_Format(PyExc_IndexError, "track_pre: lookup %zd is out of the table's %zd rows", bad_id, rows);
        return NULL;
    }
    return PyLong_FromSsize_t(nu);
}

/* state columns: touches, velocity, consistency numerator and denominator, mean ||g||^2, mean ||mean g||^2,
 * energy per lookup, non-finite flag, mean gradient (k), previous innovation (k) */
CLONES static Py_ssize_t update_rows(Py_ssize_t nu, const int64_t *uniq, const float *cnt, const float *gsk,
                                     const float *before, const float *w, Py_ssize_t dim, Py_ssize_t k,
                                     int with_delta, float *state, int64_t *counts, int64_t *out, Py_ssize_t room,
                                     uint8_t *inwin, double a_ema, double a_slow_min, double min_touches)
{
    const Py_ssize_t C = 8 + 2 * k;
    /* past this many touches every rate is at its floor (1 / (t - 1 / a_ema) < a_slow_min <= a_ema) */
    const double settled = 1.0 / a_ema + 1.0 / a_slow_min + 2.0;
    Py_ssize_t touched = 0;
    for (Py_ssize_t s = 0; s < nu; s++) {
        if (s + AHEAD < nu) {
            const int64_t ahead = uniq[s + AHEAD];
            prefetch_row(state + ahead * C, C);
            prefetch_row(w + ahead * dim, dim);
            __builtin_prefetch(inwin + ahead);
        }
        const float gmax = gsk[s * (k + 1)];
        if (gmax == 0.0f) /* a looked-up row with an exactly zero gradient did not learn; NaN is a touch */
            continue;
        const int64_t row = uniq[s];
        if (!inwin[row] && touched < room) { /* the rows whose statistics changed since the last report (its
                                               * window), once each: never more than the table's rows */
            inwin[row] = 1;
            out[touched++] = row;
        }
        const float *after = w + row * dim, *prior = before + s * dim;
        /* ||after - before||^2 in 8 independent sums (vectorised without a reduction's epilogue), and
         * whether the row is finite after the step (max |element| below inf's bits) */
        v8f part = {0};
        Py_ssize_t d = 0;
        for (; d + 8 <= dim; d += 8) {
            const v8f dd = load8(after + d) - load8(prior + d);
            part += dd * dd;
        }
        float step2 = sum8(part);
        for (; d < dim; d++) {
            const float dd = after[d] - prior[d];
            step2 += dd * dd;
        }
        /* finite after the step: a finite step2 says so (a NaN or inf in either row makes it NaN or inf);
         * otherwise (or an overflow) the row itself is read */
        const int fin = isfinite(gmax) && (isfinite(step2) || max_abs_row(after, dim) < INFINITY);
        float *st = state + row * C;
        const double t_old = st[0];
        const int bad_old = st[7] > 0;
        const double t = t_old + fin;
        double a_fast = a_ema, a_slow = a_slow_min, a_pair = a_slow_min, a_mean = a_slow_min;
        if (!fin || t <= settled) { /* the running means of a row's first touches (the rates of a settled row above) */
            const double inv_t = 1.0 / (t > 1.0 ? t : 1.0);
            a_fast = fin ? (inv_t > a_ema ? inv_t : a_ema) : 0.0;
            a_slow = fin ? (inv_t > a_slow_min ? inv_t : a_slow_min) : 0.0;
            const double inv_p = 1.0 / (t - 2.0 > 1.0 ? t - 2.0 : 1.0);
            a_pair = fin && t >= 3.0 ? (inv_p > a_slow_min ? inv_p : a_slow_min) : 0.0;
            const double warm = t - 1.0 / a_ema;
            const double inv_w = 1.0 / (warm > 1.0 ? warm : 1.0);
            a_mean = fin && warm >= 1.0 ? (inv_w > a_slow_min ? inv_w : a_slow_min) : 0.0;
        }
        const float *sk = gsk + s * (k + 1) + 1;
        float *m = st + 8, *prev = st + 8 + k;
        double dot = 0.0, in2 = 0.0, pv2 = 0.0, gn2 = 0.0, msq = 0.0;
        if (k == 8) { /* SKETCH_DIM: the same sums on one vector of 8 */
            v8f g8 = load8(sk), m8 = load8(m), p8 = load8(prev);
            const v8f zero = {0};
            const v8i finite = g8 - g8 == zero; /* -1 where finite (clean(): NaN and +-inf become 0) */
            g8 = fin ? (v8f)((v8i)g8 & finite) : zero;
            const v8f in8 = g8 - m8, mn8 = m8 + (float)a_fast * (g8 - m8);
            float sums[4];
            sum4x8(in8 * p8, in8 * in8, p8 * p8, g8 * g8, sums);
            dot = sums[0];
            in2 = sums[1];
            pv2 = sums[2];
            gn2 = sums[3];
            msq = sum8(mn8 * mn8);
            memcpy(m, &mn8, sizeof mn8);
            if (fin)
                memcpy(prev, &in8, sizeof in8);
        }
        double gs[64], inno[64];
        for (Py_ssize_t j = 0; j < k && k != 8; j++) {
            gs[j] = fin ? clean(sk[j]) : 0.0;
            inno[j] = gs[j] - m[j];
            dot += inno[j] * prev[j];
            in2 += inno[j] * inno[j];
            pv2 += (double)prev[j] * prev[j];
            gn2 += gs[j] * gs[j];
            const double mj = (1.0 - a_fast) * m[j] + a_fast * gs[j];
            m[j] = (float)mj;
            msq += mj * mj;
        }
        if (fin && k != 8)
            for (Py_ssize_t j = 0; j < k; j++)
                prev[j] = (float)inno[j];
        /* energy per lookup: from the steps that looked the row up here (a replicated table's row that only
         * other ranks looked up has no count to divide by) */
        const int looked = cnt[s] > 0.0f;
        const double target[6] = {with_delta ? clean(sqrt((double)step2)) : 0.0, dot, sqrt(in2 * pv2), gn2, msq,
                                  looked ? gn2 / cnt[s] : 0.0};
        const double rate[6] = {with_delta ? a_fast : 0.0, a_pair, a_pair, a_slow, a_mean, looked ? a_slow : 0.0};
        for (int i = 0; i < 6; i++) {
            double x = (1.0 - rate[i]) * st[1 + i] + rate[i] * target[i];
            x = x != x ? 0.0 : (x > 1e30 ? 1e30 : (x < -1e30 ? -1e30 : x));
            st[1 + i] = (float)x;
        }
        st[0] = (float)t;
        st[7] = fin ? 0.0f : 1.0f;
        counts[0] += (t > 0) - (t_old > 0);
        counts[1] += !fin - bad_old;
        counts[2] += (t >= min_touches && fin) - (t_old >= min_touches && !bad_old);
    }
    return touched;
}

static PyObject *
fastats_track_post(PyObject *Py_UNUSED(self), PyObject *args)
{
    unsigned long long uniq_p, cnt_p, gsk_p, before_p, w_p, state_p, counts_p, out_p, inwin_p;
    Py_ssize_t nu, dim, k, room;
    int with_delta;
    double a_ema, a_slow_min, min_touches;
    /* what changes every step, then the table's fixed arguments */
    if (!PyArg_ParseTuple(args, "nKKKKKpKnnnKKKddd", &nu, &uniq_p, &cnt_p, &gsk_p, &before_p, &w_p, &with_delta,
                          &out_p, &room, &dim, &k, &state_p, &counts_p, &inwin_p, &a_ema, &a_slow_min, &min_touches))
        return NULL;
    if (nu < 0 || dim <= 0 || k <= 0 || k > 64 || out_p == 0 || inwin_p == 0) {
        PyErr_SetString(PyExc_ValueError, "track_post: bad arguments");
        return NULL;
    }
    const int64_t *uniq = (const int64_t *)(uintptr_t)uniq_p;
    int64_t *counts = (int64_t *)(uintptr_t)counts_p, *out = (int64_t *)(uintptr_t)out_p;
    const float *cnt = (const float *)(uintptr_t)cnt_p, *gsk = (const float *)(uintptr_t)gsk_p;
    const float *before = (const float *)(uintptr_t)before_p, *w = (const float *)(uintptr_t)w_p;
    float *state = (float *)(uintptr_t)state_p;
    Py_ssize_t touched;
    Py_BEGIN_ALLOW_THREADS
    touched = update_rows(nu, uniq, cnt, gsk, before, w, dim, k, with_delta, state, counts, out, room,
                          (uint8_t *)(uintptr_t)inwin_p, a_ema, a_slow_min, min_touches);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(touched);
}

/* ---- embedding rows: a report (probes/embeddings/report.py, pack_native) -----------------
 *
 * The same summary as report.pack's torch operations (which stay for CUDA tables, other dtypes and
 * installs without this kernel), computed in two passes over the rows that matter: the fixed sample of
 * rows (medians, the share of eligible rows whose updates reverse, the collapse statistics' rows: copied
 * out as float64 for the caller's eigendecomposition, and their mean pairwise cosine) and the candidates
 * (the rows changed since the last report and the previous lists), ranked with a bounded heap; and the run's
 * record of the rows changed (run_noise), with the conflicted list ranked from them and the previous one.
 * O(sample + candidates x log TOP_ROWS); the torch path's ~100 small operations a table cost more than the
 * arithmetic on the CPU.
 *
 * Ties are broken by the lower row id, as the torch path's stable sort of its id-sorted candidates does. */

typedef struct {
    float key;
    int64_t id;
} ranked_t;

/* a before b in the output: a smaller key (rare) or a larger one (zombie: keys negated), then the lower id */
static inline int ranked_before(ranked_t a, ranked_t b)
{
    return a.key < b.key || (a.key == b.key && a.id < b.id);
}

/* A max-heap of the k best so far (its top: the worst of them). */
static void heap_offer(ranked_t *h, Py_ssize_t *n, Py_ssize_t k, ranked_t x)
{
    Py_ssize_t i;
    if (*n < k) {
        i = (*n)++;
        while (i > 0 && ranked_before(h[(i - 1) / 2], x)) {
            h[i] = h[(i - 1) / 2];
            i = (i - 1) / 2;
        }
        h[i] = x;
        return;
    }
    if (k == 0 || !ranked_before(x, h[0]))
        return;
    i = 0;
    for (;;) { /* sift x down from the root */
        Py_ssize_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && ranked_before(h[c], h[c + 1]))
            c++;
        if (!ranked_before(x, h[c]))
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

/* How many rows a list holds: the worst ``least``, or as many as are past its floor, at most ``k``. */
static inline Py_ssize_t listed(Py_ssize_t past, Py_ssize_t least, Py_ssize_t k)
{
    const Py_ssize_t n = past > least ? past : least;
    return n < k ? n : k;
}

static int ranked_cmp(const void *a, const void *b)
{
    const ranked_t x = *(const ranked_t *)a, y = *(const ranked_t *)b;
    return ranked_before(x, y) ? -1 : (ranked_before(y, x) ? 1 : 0);
}

static int id_cmp(const void *a, const void *b)
{
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* the lower median of v[0..n) (torch's median), reordering v; NaN when n is 0 */
static float lower_median(float *v, Py_ssize_t n)
{
    if (n == 0)
        return NAN;
    Py_ssize_t lo = 0, hi = n - 1, want = (n - 1) / 2;
    while (lo < hi) { /* quickselect, middle pivot */
        const float pivot = v[lo + (hi - lo) / 2];
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] < pivot)
                i++;
            while (v[j] > pivot)
                j--;
            if (i <= j) {
                const float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            break;
    }
    return v[want];
}

static inline float ratio_f(float num, float den) { return num / (den > 1e-30f ? den : 1e-30f); }

/* Whether a row's energy per lookup was measured: it has been looked up here. A row of a replicated table
 * that only other ranks look up is updated (its gradient is all-reduced) with no lookup here, and its energy
 * stays 0: in the median it read as the typical row's, and the rows looked up here stood out by 1e28x
 * (measured in probes/embeddings/maths.py). */
static inline int measured(const float *st)
{
    return st[6] > 0;
}

/* a row's zombie score, ln(noise) - consistency (TableState.zombie_score), from its state and the median energy */
static inline float zombie_score(const float *st, float occ_ref)
{
    const float noise = ratio_f(st[6], occ_ref);
    return logf(noise > 1e-6f ? noise : 1e-6f) - ratio_f(st[2], st[3]);
}

/* a row's run's record (TableState.run_record): the sum of its ln(noise) readings, their count, the sum of the same
 * readings in spreads (ln(noise) / the report's noise_spread), and that sum's mean at its highest once
 * ``settled`` readings were in. Its run_score (TableState.conflict_score): the peak once settled, the mean
 * before; its run_noise: exp of the mean ln(noise). */
static inline float run_score(const float *rr, Py_ssize_t settled)
{
    return rr[1] >= (float)settled ? rr[3] : rr[2] / (rr[1] > 1.0f ? rr[1] : 1.0f);
}

/* MAD_SIGMA x the median excess over ``centre`` of the values of v[0..n) above it (a robust standard deviation
 * of that side), reordering v; NaN when none is above */
static float upper_spread(float *v, Py_ssize_t n, float centre, double mad_sigma)
{
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (v[i] > centre)
            v[m++] = v[i] - centre;
    return lower_median(v, m) * (float)mad_sigma;
}

/* a candidate's five columns as the report lists them: touches, velocity, consistency, snr, noise */
static void row_columns(const float *st, float occ_ref, double *out, Py_ssize_t stride)
{
    out[0] = st[0];
    out[stride] = st[1];
    out[2 * stride] = ratio_f(st[2], st[3]);
    out[3 * stride] = ratio_f(st[5], st[4] - st[5]);
    out[4 * stride] = ratio_f(st[6], occ_ref);
}

static PyObject *
fastats_report_rows(PyObject *Py_UNUSED(self), PyObject *args)
{
    unsigned long long state_p, w_p, inwin_p, counts_p, win_p, z_p, r_p, nf_p, d_p, sample_p, pad_p, out_p, x_p, run_p,
        c_p;
    Py_ssize_t C, rows, dim, n_win, n_z, n_r, n_nf, n_d, n_sample, n_pad, k, dead_scan, n_x, n_least, n_c, run_settled;
    double min_touches, mad_sigma, z_floor, r_floor, c_floor;
    if (!PyArg_ParseTuple(args, "KnnnKKKKnKnKnKnKnKnKnnnddKKnnddKKnnd", &state_p, &C, &rows, &dim, &w_p, &inwin_p,
                          &counts_p, &win_p, &n_win, &z_p, &n_z, &r_p, &n_r, &nf_p, &n_nf, &d_p, &n_d, &sample_p,
                          &n_sample, &pad_p, &n_pad, &k, &dead_scan, &min_touches, &mad_sigma, &out_p, &x_p, &n_x,
                          &n_least, &z_floor, &r_floor, &run_p, &c_p, &n_c, &run_settled, &c_floor))
        return NULL;
    if (C < 8 || rows < 0 || dim <= 0 || n_win < 0 || n_z < 0 || n_z > k || n_r < 0 || n_r > k || n_nf < 0
        || n_nf > k || n_d < 0 || n_d > k || n_sample < 0 || n_pad < 0 || k < 0 || out_p == 0 || n_x < 0
        || (x_p == 0 && n_x > 0) || n_least < 0 || run_p == 0 || n_c < 0 || n_c > k || (c_p == 0 && n_c > 0)
        || run_settled < 1) {
        PyErr_SetString(PyExc_ValueError, "report_rows: bad arguments");
        return NULL;
    }
    const float *state = (const float *)(uintptr_t)state_p, *w = (const float *)(uintptr_t)w_p;
    uint8_t *inwin = (uint8_t *)(uintptr_t)inwin_p;
    const int64_t *counts = (const int64_t *)(uintptr_t)counts_p, *win = (const int64_t *)(uintptr_t)win_p;
    const int64_t *sample = (const int64_t *)(uintptr_t)sample_p, *pad = (const int64_t *)(uintptr_t)pad_p;
    int64_t *zl = (int64_t *)(uintptr_t)z_p, *rl = (int64_t *)(uintptr_t)r_p, *nfl = (int64_t *)(uintptr_t)nf_p;
    int64_t *dl = (int64_t *)(uintptr_t)d_p, *cl = (int64_t *)(uintptr_t)c_p;
    float *run = (float *)(uintptr_t)run_p;
    double *out = (double *)(uintptr_t)out_p;
    double *x = (double *)(uintptr_t)x_p, *xsum = calloc((size_t)dim, sizeof(double));
    float *scratch = malloc((size_t)(3 * n_sample + 1) * sizeof(float));
    uint8_t *ok = malloc((size_t)n_sample + 1); /* which rows of the sample were updated and are finite */
    ranked_t *heaps = malloc((size_t)(3 * k + 1) * sizeof(ranked_t));
    const Py_ssize_t n_cand = n_win + n_z + n_r + n_nf;
    int64_t *bad = malloc((size_t)(n_cand + 1) * sizeof(int64_t));
    ranked_t *zc = malloc((size_t)(n_cand + 1) * sizeof(ranked_t)), *rc = malloc((size_t)(n_cand + 1) * sizeof(ranked_t));
    ranked_t *cc = malloc((size_t)(n_win + n_c + 1) * sizeof(ranked_t));
    if (scratch == NULL || ok == NULL || heaps == NULL || bad == NULL || xsum == NULL || zc == NULL || rc == NULL
        || cc == NULL) {
        free(xsum);
        free(ok);
        free(scratch);
        free(heaps);
        free(bad);
        free(zc);
        free(rc);
        free(cc);
        return PyErr_NoMemory();
    }
    float touch_median, occ_median;
    Py_ssize_t nz = 0, nr = 0, nnf = 0, nd = 0, n_bad = 0, m = 0, nc = 0;
    double cosine = NAN;
    Py_BEGIN_ALLOW_THREADS
    /* the fixed sample: medians of touches (rows updated) and of energy per lookup (eligible rows with one
     * measured: looked up here, see measured()), the eligible rows whose consistency is negative, and which
     * rows the collapse statistics read */
    Py_ssize_t n_t = 0, n_occ = 0, n_el = 0, neg = 0;
    float *touched_v = scratch, *occ_v = scratch + n_sample, *score_v = scratch + 2 * n_sample;
    for (Py_ssize_t i = 0; i < n_sample; i++) {
        const float *st = state + sample[i] * C;
        const float t = st[0];
        const int b = st[7] > 0, el = t >= min_touches && !b;
        if (t > 0)
            touched_v[n_t++] = t;
        if (el) {
            n_el++;
            neg += st[2] < 0; /* consistency < 0: its numerator is */
            if (measured(st))
                occ_v[n_occ++] = st[6];
        }
        ok[i] = t > 0 && !b;
    }
    /* the collapse statistics' rows: the first n_x of the sample updated and finite, less those holding
     * NaN or inf (a row can go non-finite without a touch: dense optimizer state), as float64 rows of x; and
     * the sum of their unit vectors (the mean pairwise cosine) */
    for (Py_ssize_t i = 0, taken = 0; i < n_sample && taken < n_x; i++) {
        if (!ok[i])
            continue;
        taken++;
        const float *src = w + sample[i] * dim;
        double *dst = x + m * dim, n2 = 0.0;
        int fin = 1;
        for (Py_ssize_t d = 0; d < dim; d++) {
            dst[d] = src[d];
            fin &= isfinite(src[d]) != 0;
            n2 += dst[d] * dst[d];
        }
        if (!fin)
            continue;
        const double inv = 1.0 / fmax(sqrt(n2), 1e-30);
        for (Py_ssize_t d = 0; d < dim; d++)
            xsum[d] += dst[d] * inv;
        m++;
    }
    if (m >= 2) {
        double s2 = 0.0;
        for (Py_ssize_t d = 0; d < dim; d++)
            s2 += xsum[d] * xsum[d];
        cosine = (s2 - (double)m) / ((double)m * (double)(m - 1));
    }
    touch_median = lower_median(touched_v, n_t);
    occ_median = lower_median(occ_v, n_occ);
    /* the spread of the log energy per lookup above the median, the side zombie_embedding reads: MAD_SIGMA x
     * the median ln(energy / median) of the same rows above it (a robust standard deviation of that side),
     * NaN without a positive median or a row above it */
    float spread = NAN, score_median = NAN, score_spread = NAN;
    if (occ_median > 0) {
        /* the zombie scores, ln(noise) - consistency (as the zombies are ranked), their median and the spread
         * of those above it, the same way: what zombie_embedding reads a listed row's score against */
        Py_ssize_t n_s = 0;
        for (Py_ssize_t i = 0; i < n_sample; i++) { /* the eligible rows again (occ_v is reordered) */
            const float *st = state + sample[i] * C;
            if (st[0] >= min_touches && !(st[7] > 0) && measured(st))
                score_v[n_s++] = zombie_score(st, occ_median);
        }
        score_median = lower_median(score_v, n_s);
        score_spread = upper_spread(score_v, n_s, score_median, mad_sigma);
        for (Py_ssize_t i = 0; i < n_occ; i++)
            occ_v[i] = logf(occ_v[i] / occ_median);
        spread = upper_spread(occ_v, n_occ, 0.0f, mad_sigma);
    }
    const float often = touch_median == touch_median ? touch_median : INFINITY;
    const float occ_ref = occ_median == occ_median ? occ_median : INFINITY;

    /* the candidates, each once (flag 2 in inwin while this report runs), with their keys; then the zombies
     * and the rarest by heap: the worst n_least of each kind, and further ones up to k while they are past
     * their floor (a zombie score of at least z_floor, touches below r_floor x the median) */
    ranked_t *zh = heaps, *rh = heaps + k;
    const int64_t *lists[4] = {win, zl, rl, nfl};
    const Py_ssize_t sizes[4] = {n_win, n_z, n_r, n_nf};
    const float rare_below = (float)r_floor * touch_median; /* NaN without a median: no row is past it */
    Py_ssize_t n_zc = 0, n_rc = 0, z_past = 0, r_past = 0;
    for (int l = 0; l < 4; l++)
        for (Py_ssize_t i = 0; i < sizes[l]; i++) {
            const int64_t row = lists[l][i];
            if (inwin[row] == 2)
                continue;
            inwin[row] = 2;
            const float *st = state + row * C;
            const float t = st[0];
            const int b = st[7] > 0;
            if (b) {
                bad[n_bad++] = row;
                continue;
            }
            if (t <= 0)
                continue;
            rc[n_rc++] = (ranked_t){t, row};
            r_past += t < rare_below;
            if (t >= often && t >= min_touches && measured(st)) {
                const float score = zombie_score(st, occ_ref);
                if (isfinite(score)) {
                    zc[n_zc++] = (ranked_t){-score, row};
                    z_past += score >= (float)z_floor;
                }
            }
        }
    /* the run's record (report._conflicts): each window row eligible with its energy measured adds its
     * ln(noise), and the same in spreads, when the report has a spread; the mean in spreads' highest is kept
     * once run_settled readings are in. Then the window and the previous conflicted list, each once (flag 4),
     * are ranked by run_score, among the finite rows updated at least as often as the median row */
    const int spread_ok = spread > 0 && spread < INFINITY;
    ranked_t *ch = heaps + 2 * k;
    Py_ssize_t n_cc = 0, c_past = 0;
    const int64_t *c_lists[2] = {win, cl};
    const Py_ssize_t c_sizes[2] = {n_win, n_c};
    for (int l = 0; l < 2; l++)
        for (Py_ssize_t i = 0; i < c_sizes[l]; i++) {
            const int64_t row = c_lists[l][i];
            if (inwin[row] & 4)
                continue;
            inwin[row] |= 4;
            const float *st = state + row * C;
            const int b = st[7] > 0;
            float *rr = run + 4 * row;
            if (l == 0 && spread_ok && st[0] >= min_touches && !b && measured(st) && occ_ref < INFINITY) {
                const float noise = ratio_f(st[6], occ_ref), ln = logf(noise > 1e-6f ? noise : 1e-6f);
                rr[0] += ln;
                rr[1] += 1.0f;
                rr[2] += ln / spread;
                if (rr[1] >= (float)run_settled && rr[2] / rr[1] > rr[3])
                    rr[3] = rr[2] / rr[1];
            }
            if (rr[1] > 0 && !b && st[0] >= often) {
                const float score = run_score(rr, run_settled);
                if (isfinite(score)) {
                    cc[n_cc++] = (ranked_t){-score, row};
                    c_past += score >= (float)c_floor;
                }
            }
        }
    for (int l = 0; l < 4; l++) /* clear the flags: the window starts empty */
        for (Py_ssize_t i = 0; i < sizes[l]; i++)
            inwin[lists[l][i]] = 0;
    for (Py_ssize_t i = 0; i < n_c; i++)
        inwin[cl[i]] = 0;
    const Py_ssize_t kz = listed(z_past, n_least, k), kr = listed(r_past, n_least, k), kc = listed(c_past, n_least, k);
    for (Py_ssize_t i = 0; i < n_zc; i++)
        heap_offer(zh, &nz, kz, zc[i]);
    for (Py_ssize_t i = 0; i < n_rc; i++)
        heap_offer(rh, &nr, kr, rc[i]);
    for (Py_ssize_t i = 0; i < n_cc; i++)
        heap_offer(ch, &nc, kc, cc[i]);
    qsort(zh, (size_t)nz, sizeof(ranked_t), ranked_cmp);
    qsort(rh, (size_t)nr, sizeof(ranked_t), ranked_cmp);
    qsort(ch, (size_t)nc, sizeof(ranked_t), ranked_cmp);
    qsort(bad, (size_t)n_bad, sizeof(int64_t), id_cmp);
    nnf = n_bad < k ? n_bad : k;

    /* dead: the previous list, less the rows since updated or gone non-finite, then refilled by a scan of
     * the ids from where the last one stopped */
    for (Py_ssize_t i = 0; i < n_d; i++) {
        const float *st = state + dl[i] * C;
        if (st[0] == 0 && !(st[7] > 0))
            dl[nd++] = dl[i];
    }
    for (; nd < k && dead_scan < rows; dead_scan++) {
        const float *st = state + dead_scan * C;
        int is_pad = 0;
        for (Py_ssize_t p = 0; p < n_pad; p++)
            is_pad |= pad[p] == dead_scan;
        if (st[0] == 0 && !(st[7] > 0) && !is_pad)
            dl[nd++] = dead_scan;
    }

    /* out: the scalars, the non-finite ids, the zombies' ids and columns, the rarest's, the collapse
     * statistics (effective rank, mean cosine, rows), the dead ids */
    double untouched_bad = 0, nan_count = 0, inf_count = 0;
    double *o = out + 12;
    for (Py_ssize_t i = 0; i < nnf; i++) {
        const int64_t row = bad[i];
        nfl[i] = row;
        *o++ = (double)row;
        untouched_bad += state[row * C] == 0;
        const float *x = w + row * dim;
        for (Py_ssize_t d = 0; d < dim; d++) {
            nan_count += isnan(x[d]);
            inf_count += isinf(x[d]);
        }
    }
    for (Py_ssize_t i = 0; i < nz; i++)
        zl[i] = zh[i].id;
    for (Py_ssize_t i = 0; i < nr; i++)
        rl[i] = rh[i].id;
    const int64_t *ranked_lists[2] = {zl, rl};
    const Py_ssize_t ranked_n[2] = {nz, nr};
    for (int l = 0; l < 2; l++) {
        const Py_ssize_t n = ranked_n[l];
        for (Py_ssize_t i = 0; i < n; i++) {
            o[i] = (double)ranked_lists[l][i];
            row_columns(state + ranked_lists[l][i] * C, occ_ref, o + n + i, n);
        }
        o += 6 * n;
    }
    o[0] = NAN; /* the effective rank: the caller's (an eigendecomposition) */
    o[1] = cosine;
    o[2] = (double)m;
    o += 3;
    for (Py_ssize_t i = 0; i < nd; i++)
        o[i] = (double)dl[i];
    o += nd + 1; /* and the caller's flag: whether rows not looked up had a gradient */
    for (Py_ssize_t i = 0; i < nc; i++) { /* the conflicted rows: ids, touches, noise, run_noise, run_score, reports */
        const int64_t row = ch[i].id;
        const float *st = state + row * C, *rr = run + 4 * row;
        cl[i] = row;
        o[i] = (double)row;
        o[nc + i] = st[0];
        o[2 * nc + i] = ratio_f(st[6], occ_ref);
        o[3 * nc + i] = expf(rr[0] / (rr[1] > 1.0f ? rr[1] : 1.0f));
        o[4 * nc + i] = run_score(rr, run_settled);
        o[5 * nc + i] = rr[1];
    }
    const double scalars[12] = {(double)counts[0], (double)counts[1], (double)counts[2], (double)neg, (double)n_el,
                                touch_median, untouched_bad, nan_count, inf_count, spread, score_median, score_spread};
    memcpy(out, scalars, sizeof scalars);
    Py_END_ALLOW_THREADS
    free(xsum);
    free(ok);
    free(scratch);
    free(heaps);
    free(bad);
    free(zc);
    free(rc);
    free(cc);
    return Py_BuildValue("nnnnnddnn", nz, nr, nnf, nd, dead_scan, (double)touch_median, (double)occ_median, m, nc);
}

/* ---- a report's listed rows as the event's dicts (probes/embeddings/report.py, listed_rows) -----------
 *
 * A report lists up to 2 x TOP_ROWS rows a table, six numbers each, which the event carries as dicts. Built
 * here from the report's host list (six columns of n values from ``at``): the same dicts as listed_rows'
 * comprehension, the row id and touches as ints, a non-finite statistic as None; the list's float objects
 * are reused, not copied. About a quarter of the comprehension's time, which was a third of a report's. */

static PyObject *
fastats_row_dicts(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *raw, *keys;
    Py_ssize_t at, n;
    if (!PyArg_ParseTuple(args, "O!nnO!", &PyList_Type, &raw, &at, &n, &PyTuple_Type, &keys))
        return NULL;
    if (PyTuple_GET_SIZE(keys) != 6 || at < 0 || n < 0 || at > PyList_GET_SIZE(raw)
        || n > (PyList_GET_SIZE(raw) - at) / 6) {
        PyErr_SetString(PyExc_ValueError, "row_dicts: six keys and six columns of n values inside the list");
        return NULL;
    }
    /* Each dict is a copy of one holding the six keys, whose values are then replaced: a fresh dict would
     * grow its table at the sixth key. */
    PyObject *out = PyList_New(n), *tmpl = PyDict_New();
    if (out == NULL || tmpl == NULL)
        goto fail;
    for (Py_ssize_t c = 0; c < 6; c++)
        if (PyDict_SetItem(tmpl, PyTuple_GET_ITEM(keys, c), Py_None) < 0)
            goto fail;
    PyObject **col = &PyList_GET_ITEM(raw, at);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyDict_Copy(tmpl);
        if (d == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, d);
        for (Py_ssize_t c = 0; c < 6; c++) {
            PyObject *x = col[c * n + i], *v;
            const double f = PyFloat_AsDouble(x);
            if (f == -1.0 && PyErr_Occurred())
                goto fail;
            if (c < 2) /* the row id and its touches: int(x) */
                v = PyLong_FromDouble(f);
            else if (!isfinite(f))
                v = Py_NewRef(Py_None);
            else
                v = PyFloat_CheckExact(x) ? Py_NewRef(x) : PyFloat_FromDouble(f);
            if (v == NULL)
                goto fail;
            const int err = PyDict_SetItem(d, PyTuple_GET_ITEM(keys, c), v);
            Py_DECREF(v);
            if (err < 0)
                goto fail;
        }
    }
    Py_DECREF(tmpl);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(tmpl);
    return NULL;
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
    {"nonzero_rows", fastats_nonzero_rows, METH_VARARGS,
     "nonzero_rows(grad_ptr, rows, dim, out_ptr) -> int\n\n"
     "Write to ``out`` (room for ``rows`` int64) the rows of a contiguous float32 (rows, dim) buffer with an\n"
     "element that is not +-0 (NaN counts), in order; return how many."},
    {"track_pre", fastats_track_pre, METH_VARARGS,
     "One tracked step of an embedding table, before the optimizer step (see probes/embeddings/native.py)."},
    {"track_post", fastats_track_post, METH_VARARGS,
     "One tracked step of an embedding table, after the optimizer step (see probes/embeddings/native.py): writes\n"
     "the rows it updated that are not flagged in ``inwin`` (one byte a row) to ``out`` (room for the\n"
     "step's distinct rows), flags them, and returns how many."},
    {"report_rows", fastats_report_rows, METH_VARARGS,
     "The lists and counts of an embedding table's report (see probes/embeddings/report.py, pack_native)\n"
     "-> (zombies, rarest, non-finite, dead, dead_scan, touch median, energy median, collapse rows, conflicted);\n"
     "it adds the window's rows to the run's record (as report._conflicts) and ranks the conflicted list."},
    {"row_dicts", fastats_row_dicts, METH_VARARGS,
     "row_dicts(raw, at, n, keys) -> list of n dicts\n\n"
     "A report's listed rows (see probes/embeddings/report.py, listed_rows): six columns of n values of the\n"
     "list ``raw`` from ``at``, under the six ``keys``; the first two as ints, a non-finite value as None."},
    {"outside", fastats_outside, METH_VARARGS,
     "outside(data_ptr, numel, lo, hi, is_double) -> int\n\n"
     "How many elements of a contiguous buffer are <= lo or >= hi (NaN: neither)."},
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

/* Raised whenever an entry point's arguments change: probes/stats.py ignores a build of another version
 * (a stale .so left by an older install) and keeps its torch path. */
#define FASTATS_VERSION 19

PyMODINIT_FUNC
PyInit__fastats(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "VERSION", FASTATS_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
