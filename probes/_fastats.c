/* The probe's native CPU passes (probes/stats.py, probes/collect.py, probes/embeddings.py).
 *
 * - stats: the eight raw sums of a tensor (sum, sum of squares, NaN/Inf/zero counts, min and max over the
 *   finite elements), each element read once, NaN/Inf masked in the same pass. The torch path takes five
 *   or six vectorised passes per tensor and as many dispatcher calls and host reads; for the small
 *   tensors of a sampled step the calls cost more than the arithmetic.
 * - copy_sumsq / diff_sumsq: the update ratio's two norms, one while copying the weights before the
 *   optimizer step, one over the difference after it.
 * - outside / alive: a bounded activation's saturated elements, a ReLU output's live units.
 * - track_pre / track_post: one tracked step of an embedding table (see below).
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


/* ---- embedding rows: one tracked step, applied as it happens (probes/embeddings.py, TableState) ----
 *
 * The same recurrences as TableState._fold, which applies a queue of steps at once with vectorised torch
 * operations (a segmented scan); here each step updates its rows' statistics directly, in the optimizer
 * step's hooks: O(lookups x width) a step, no queue, no fold, no memory per row beyond the state.
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

/* Per distinct row of a step: the gradient row's largest |element| (NaN when it holds a NaN) and its
 * sketch (g @ proj, proj (dim, k); g itself when proj is NULL and k == dim), and a copy of the row. */
CLONES static void reduce_rows(Py_ssize_t nu, const int64_t *uniq, const float *grad, const float *acc,
                               const float *w, const float *proj, Py_ssize_t dim, Py_ssize_t k, float *gsk,
                               float *before)
{
    for (Py_ssize_t s = 0; s < nu; s++) {
        const float *g = grad != NULL ? grad + uniq[s] * dim : acc + s * dim;
        float *out = gsk + s * (k + 1);
        float mx = 0.0f;
        int nan = 0;
        _Pragma("omp simd reduction(max : mx) reduction(| : nan)")
        for (Py_ssize_t d = 0; d < dim; d++) {
            const float a = fabsf(g[d]);
            nan |= a != a;
            mx = a > mx ? a : mx;
        }
        out[0] = nan ? NAN : mx;
        if (proj == NULL) {
            memcpy(out + 1, g, (size_t)dim * sizeof(float));
        } else if (k == 8) { /* SKETCH_DIM: one vector of 8 per gradient element */
            float o[8] = {0};
            for (Py_ssize_t d = 0; d < dim; d++) {
                const float gd = g[d];
                const float *pr = proj + d * 8;
                _Pragma("omp simd")
                for (int j = 0; j < 8; j++)
                    o[j] += gd * pr[j];
            }
            memcpy(out + 1, o, sizeof o);
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
        memcpy(before + s * dim, w + uniq[s] * dim, (size_t)dim * sizeof(float));
    }
}

static PyObject *
fastats_track_pre(PyObject *Py_UNUSED(self), PyObject *args)
{
    unsigned long long ids_p, grad_p, gi_p, gv_p, w_p, proj_p, pad_p, keys_p, slots_p, uniq_p, cnt_p, gsk_p,
        before_p, acc_p;
    Py_ssize_t n_ids, rows, dim, k, n_g, n_pad, h;
    /* what changes every step, then the table's fixed arguments, then the scratch */
    if (!PyArg_ParseTuple(args, "KnKKKnKnnnKKnKKnKKKKK", &ids_p, &n_ids, &grad_p, &gi_p, &gv_p, &n_g, &w_p, &rows,
                          &dim, &k, &proj_p, &pad_p, &n_pad, &keys_p, &slots_p, &h, &uniq_p, &cnt_p, &gsk_p,
                          &before_p, &acc_p))
        return NULL;
    const int64_t *ids = (const int64_t *)(uintptr_t)ids_p, *gi = (const int64_t *)(uintptr_t)gi_p;
    const int64_t *pad = (const int64_t *)(uintptr_t)pad_p;
    const float *grad = (const float *)(uintptr_t)grad_p, *gv = (const float *)(uintptr_t)gv_p;
    const float *w = (const float *)(uintptr_t)w_p, *proj = (const float *)(uintptr_t)proj_p;
    int64_t *keys = (int64_t *)(uintptr_t)keys_p, *slots = (int64_t *)(uintptr_t)slots_p;
    int64_t *uniq = (int64_t *)(uintptr_t)uniq_p;
    float *cnt = (float *)(uintptr_t)cnt_p, *gsk = (float *)(uintptr_t)gsk_p, *before = (float *)(uintptr_t)before_p;
    float *acc = (float *)(uintptr_t)acc_p;
    if (n_ids < 0 || dim <= 0 || k <= 0 || n_g < 0 || n_pad < 0 || h < 2 * n_ids || (h & (h - 1)) != 0
        || (proj == NULL && k != dim) || (grad == NULL && (gi == NULL || gv == NULL || acc == NULL) && n_g > 0)) {
        PyErr_SetString(PyExc_ValueError, "track_pre: bad arguments");
        return NULL;
    }
    Py_ssize_t bad_id = -1, nu = 0;
    Py_BEGIN_ALLOW_THREADS
    memset(keys, 0xff, (size_t)h * sizeof(int64_t)); /* every key -1 */
    for (Py_ssize_t i = 0; i < n_ids; i++) {
        const int64_t id = ids[i];
        if (id < 0 || id >= rows) {
            bad_id = i;
            break;
        }
        int is_pad = 0;
        for (Py_ssize_t p = 0; p < n_pad; p++)
            is_pad |= pad[p] == id;
        if (is_pad)
            continue;
        const Py_ssize_t before_nu = nu, s = slot_of(id, keys, slots, h, &nu, 1);
        if (nu > before_nu) {
            uniq[s] = id;
            cnt[s] = 1.0f;
        } else {
            cnt[s] += 1.0f;
        }
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
                                     int with_delta, float *state, int64_t *counts, int64_t *out, double a_ema,
                                     double a_slow_min, double min_touches)
{
    const Py_ssize_t C = 8 + 2 * k;
    Py_ssize_t touched = 0;
    for (Py_ssize_t s = 0; s < nu; s++) {
        const float gmax = gsk[s * (k + 1)];
        if (gmax == 0.0f) /* a looked-up row with an exactly zero gradient did not learn; NaN is a touch */
            continue;
        const int64_t row = uniq[s];
        out[touched++] = row; /* the rows whose statistics change (the report's window) */
        const float *after = w + row * dim, *prior = before + s * dim;
        float step2 = 0.0f;
        int bad = 0;
        _Pragma("omp simd reduction(+ : step2) reduction(| : bad)")
        for (Py_ssize_t d = 0; d < dim; d++) {
            const float a = after[d], dd = a - prior[d];
            bad |= !((a - a) == 0.0f); /* NaN or +-Inf */
            step2 += dd * dd;
        }
        const int fin = !bad && isfinite(gmax);
        float *st = state + row * C;
        const double t_old = st[0];
        const int bad_old = st[7] > 0;
        const double t = t_old + fin;
        const double inv_t = 1.0 / (t > 1.0 ? t : 1.0);
        const double a_fast = fin ? (inv_t > a_ema ? inv_t : a_ema) : 0.0;
        const double a_slow = fin ? (inv_t > a_slow_min ? inv_t : a_slow_min) : 0.0;
        const double inv_p = 1.0 / (t - 2.0 > 1.0 ? t - 2.0 : 1.0);
        const double a_pair = fin && t >= 3.0 ? (inv_p > a_slow_min ? inv_p : a_slow_min) : 0.0;
        const double warm = t - 1.0 / a_ema;
        const double inv_w = 1.0 / (warm > 1.0 ? warm : 1.0);
        const double a_mean = fin && warm >= 1.0 ? (inv_w > a_slow_min ? inv_w : a_slow_min) : 0.0;
        const float *sk = gsk + s * (k + 1) + 1;
        float *m = st + 8, *prev = st + 8 + k;
        double gs[64], inno[64], dot = 0.0, in2 = 0.0, pv2 = 0.0, gn2 = 0.0, msq = 0.0;
        for (Py_ssize_t j = 0; j < k; j++) {
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
        if (fin)
            for (Py_ssize_t j = 0; j < k; j++)
                prev[j] = (float)inno[j];
        const double target[6] = {with_delta ? clean(sqrt((double)step2)) : 0.0, dot, sqrt(in2 * pv2), gn2, msq,
                                  gn2 / cnt[s]};
        const double rate[6] = {with_delta ? a_fast : 0.0, a_pair, a_pair, a_slow, a_mean, a_slow};
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
    unsigned long long uniq_p, cnt_p, gsk_p, before_p, w_p, state_p, counts_p, out_p;
    Py_ssize_t nu, dim, k;
    int with_delta;
    double a_ema, a_slow_min, min_touches;
    /* what changes every step, then the table's fixed arguments */
    if (!PyArg_ParseTuple(args, "nKKKKKpKnnKKddd", &nu, &uniq_p, &cnt_p, &gsk_p, &before_p, &w_p, &with_delta,
                          &out_p, &dim, &k, &state_p, &counts_p, &a_ema, &a_slow_min, &min_touches))
        return NULL;
    if (nu < 0 || dim <= 0 || k <= 0 || k > 64 || out_p == 0) {
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
    touched = update_rows(nu, uniq, cnt, gsk, before, w, dim, k, with_delta, state, counts, out, a_ema,
                          a_slow_min, min_touches);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(touched);
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
    {"track_pre", fastats_track_pre, METH_VARARGS,
     "One tracked step of an embedding table, before the optimizer step (see probes/embeddings.py)."},
    {"track_post", fastats_track_post, METH_VARARGS,
     "One tracked step of an embedding table, after the optimizer step (see probes/embeddings.py): writes\n"
     "the rows it updated to ``out`` (room for the step's distinct rows) and returns how many."},
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
#define FASTATS_VERSION 2

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
