/*
 * A small external C extension that uses mamba_ext only through its C API
 * (<mamba_ext/mamba_ext.h> and the capsule table); tests/test_capi.py compiles
 * it against the INSTALLED package's header and calls it on golden cases.
 *
 * Arrays come in as Python buffers (numpy arrays), C-contiguous; T is float
 * or double, chosen by the buffers' format. Size letters as in the header.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <mamba_ext/mamba_ext.h>

/* ------------------------------------------------------------ buffers */

#define MAX_BUFS 160

typedef struct {
    Py_buffer view[MAX_BUFS];
    int n;
} bufset;

static void bufset_release(bufset *s)
{
    for (int i = 0; i < s->n; i++)
        PyBuffer_Release(&s->view[i]);
    s->n = 0;
}

/* Pointer to the data of `o` (C-contiguous, item kind `kind`: 'f' float32,
 * 'd' float64, 'q' int64), NULL with an exception on mismatch. */
static void *bufset_get(bufset *s, PyObject *o, char kind, int writable, const char *what)
{
    if (s->n >= MAX_BUFS) {
        PyErr_SetString(PyExc_ValueError, "too many buffers");
        return NULL;
    }
    Py_buffer *v = &s->view[s->n];
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, v, flags) < 0)
        return NULL;
    s->n++;
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    int ok = (kind == 'f' && strcmp(f, "f") == 0) || (kind == 'd' && strcmp(f, "d") == 0) ||
             (kind == 'q' && v->itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0));
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: expected item kind '%c', got format '%s'",
                     what, kind, v->format ? v->format : "B");
        PyBuffer_Release(v);
        s->n--;
        return NULL;
    }
    return v->buf;
}

/* Fill ptrs[0..n) from the sequence `seq` of n buffers. */
static int bufset_list(bufset *s, PyObject *seq, Py_ssize_t n, char kind, int writable,
                       void **ptrs, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd arrays, got %zd", what, n,
                     PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        ptrs[i] = bufset_get(s, PySequence_Fast_GET_ITEM(fast, i), kind, writable, what);
        if (ptrs[i] == NULL) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static int parse_dims(PyObject *t, mamba_ext_dims *d)
{
    /* (B, L, Dm, D, N, K, R) */
    memset(d, 0, sizeof *d);
    if (!PyArg_ParseTuple(t, "nnnnnnn", &d->B, &d->L, &d->Dm, &d->D, &d->N, &d->K, &d->R))
        return -1;
    d->eps = 1e-6;
    d->discretization = 0;
    return 0;
}

static PyObject *status_error(int r, const char *what)
{
    return PyErr_Format(PyExc_RuntimeError, "%s returned status %d", what, r);
}

/* ------------------------------------------------------------ entries */

/* api_info() -> (abi_version, count, header ABI version, header count) */
static PyObject *api_info(PyObject *self, PyObject *args)
{
    return Py_BuildValue("iiii", mamba_ext_API->abi_version, mamba_ext_API->count,
                         MAMBA_EXT_ABI_VERSION, MAMBA_EXT_API_COUNT);
}

/* load_api(abi_version, min_count) -> None; raises ImportError on mismatch. */
static PyObject *load_api(PyObject *self, PyObject *args)
{
    int abi, count;
    if (!PyArg_ParseTuple(args, "ii", &abi, &count))
        return NULL;
    if (mamba_ext_load_api(abi, count) == NULL)
        return NULL;
    Py_RETURN_NONE;
}

/* block_forward_backward(dims, x, dout, params[13], out, dx, grads[13]) -> cache_len
 * out (B, L, Dm) written; dx (B, L, Dm) and grads += (zero them first). */
static PyObject *block_forward_backward(PyObject *self, PyObject *args)
{
    PyObject *dims_t, *x_o, *dout_o, *params_o, *out_o, *dx_o, *grads_o;
    if (!PyArg_ParseTuple(args, "OOOOOOO", &dims_t, &x_o, &dout_o, &params_o, &out_o,
                          &dx_o, &grads_o))
        return NULL;
    mamba_ext_dims d;
    if (parse_dims(dims_t, &d) < 0)
        return NULL;

    bufset s = {.n = 0};
    PyObject *result = NULL;
    void *params[MAMBA_EXT_NPARAMS], *grads[MAMBA_EXT_NPARAMS];
    void *cache = NULL;
    void *x = bufset_get(&s, x_o, 'f', 0, "x");
    char kind = 'f';
    if (x == NULL) {                     /* not float32: try float64 */
        PyErr_Clear();
        kind = 'd';
        if ((x = bufset_get(&s, x_o, 'd', 0, "x")) == NULL)
            goto done;
    }
    size_t item = kind == 'f' ? sizeof(float) : sizeof(double);
    void *dout = bufset_get(&s, dout_o, kind, 0, "dout");
    void *out = dout ? bufset_get(&s, out_o, kind, 1, "out") : NULL;
    void *dx = out ? bufset_get(&s, dx_o, kind, 1, "dx") : NULL;
    if (dx == NULL)
        goto done;
    Py_ssize_t n_act = d.B * d.L * d.Dm;
    for (int i = 0; i < 4; i++) {
        if (s.view[i].len != n_act * (Py_ssize_t)item) {
            PyErr_SetString(PyExc_ValueError, "x, dout, out, dx must have B*L*Dm elements");
            goto done;
        }
    }
    if (bufset_list(&s, params_o, MAMBA_EXT_NPARAMS, kind, 0, params, "params") < 0 ||
        bufset_list(&s, grads_o, MAMBA_EXT_NPARAMS, kind, 1, grads, "grads") < 0)
        goto done;

    /* The caller owns the cache: query its length, allocate, free. */
    Py_ssize_t n_cache = mamba_ext_API->block_cache_len(&d);
    if (n_cache <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_cache_len returned <= 0");
        goto done;
    }
    cache = malloc((size_t)n_cache * item);
    if (cache == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int r;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f') {
        r = mamba_ext_API->block_forward_f32(out, cache, x, (const float *const *)params, &d, 2);
        if (r == MAMBA_EXT_OK)
            r = mamba_ext_API->block_backward_f32(dx, (float *const *)grads, dout, cache,
                                                  (const float *const *)params, &d, 2);
    } else {
        r = mamba_ext_API->block_forward_f64(out, cache, x, (const double *const *)params, &d, 2);
        if (r == MAMBA_EXT_OK)
            r = mamba_ext_API->block_backward_f64(dx, (double *const *)grads, dout, cache,
                                                  (const double *const *)params, &d, 2);
    }
    Py_END_ALLOW_THREADS
    if (r != MAMBA_EXT_OK) {
        status_error(r, "block forward/backward");
        goto done;
    }
    result = PyLong_FromSsize_t(n_cache);
done:
    free(cache);
    bufset_release(&s);
    return result;
}

/* model_loss_and_grads(V, n_layers, dims, tokens, targets, weights[3], layer_params,
 *                      grads[3], g_layer_params) -> loss    (float32)
 * weights = (embedding, final_norm, lm_head_bias); grads likewise (+=). */
static PyObject *model_loss_and_grads(PyObject *self, PyObject *args)
{
    Py_ssize_t V, n_layers;
    PyObject *dims_t, *tok_o, *tgt_o, *w_o, *lp_o, *g_o, *glp_o;
    if (!PyArg_ParseTuple(args, "nnOOOOOOO", &V, &n_layers, &dims_t, &tok_o, &tgt_o, &w_o,
                          &lp_o, &g_o, &glp_o))
        return NULL;
    mamba_ext_model_dims md;
    if (parse_dims(dims_t, &md.block) < 0)
        return NULL;
    md.V = V;
    md.n_layers = n_layers;
    if (n_layers < 0 || n_layers * MAMBA_EXT_NPARAMS > 64) {
        PyErr_SetString(PyExc_ValueError, "n_layers out of the test's range");
        return NULL;
    }
    bufset s = {.n = 0};
    PyObject *result = NULL;
    void *w[3], *g[3], *lp[64], *glp[64];
    void *tok = bufset_get(&s, tok_o, 'q', 0, "tokens");
    void *tgt = tok ? bufset_get(&s, tgt_o, 'q', 0, "targets") : NULL;
    if (tgt == NULL || bufset_list(&s, w_o, 3, 'f', 0, w, "weights") < 0 ||
        bufset_list(&s, g_o, 3, 'f', 1, g, "grads") < 0 ||
        bufset_list(&s, lp_o, n_layers * MAMBA_EXT_NPARAMS, 'f', 0, lp, "layer_params") < 0 ||
        bufset_list(&s, glp_o, n_layers * MAMBA_EXT_NPARAMS, 'f', 1, glp, "g_layer_params") < 0)
        goto done;
    double loss = 0.0;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = mamba_ext_API->model_loss_and_grads_f32(
        &loss, g[0], g[1], g[2], (float *const *)glp, tok, tgt, w[0], w[1], w[2],
        (const float *const *)lp, &md, 1.0, 0, 2);
    Py_END_ALLOW_THREADS
    if (r != MAMBA_EXT_OK) {
        status_error(r, "model_loss_and_grads_f32");
        goto done;
    }
    result = PyFloat_FromDouble(loss);
done:
    bufset_release(&s);
    return result;
}

/* adamw_step(w, m, v, g, lr, beta1, beta2, eps, weight_decay, step) -> skipped
 * (float32 or float64 by w's format; max_delta 0, grad_scale 1, 1 thread). */
static PyObject *adamw_step(PyObject *self, PyObject *args)
{
    PyObject *w_o, *m_o, *v_o, *g_o;
    double lr, b1, b2, eps, wd;
    long long step;
    if (!PyArg_ParseTuple(args, "OOOOdddddL", &w_o, &m_o, &v_o, &g_o, &lr, &b1, &b2, &eps,
                          &wd, &step))
        return NULL;
    bufset s = {.n = 0};
    PyObject *result = NULL;
    char kind = 'f';
    void *w = bufset_get(&s, w_o, 'f', 1, "w");
    if (w == NULL) {
        PyErr_Clear();
        kind = 'd';
        if ((w = bufset_get(&s, w_o, 'd', 1, "w")) == NULL)
            goto done;
    }
    void *m = bufset_get(&s, m_o, kind, 1, "m");
    void *v = m ? bufset_get(&s, v_o, kind, 1, "v") : NULL;
    void *g = v ? bufset_get(&s, g_o, kind, 0, "g") : NULL;
    if (g == NULL)
        goto done;
    Py_ssize_t n = s.view[0].len / s.view[0].itemsize;
    for (int i = 1; i < 4; i++) {
        if (s.view[i].len != s.view[0].len) {
            PyErr_SetString(PyExc_ValueError, "w, m, v, g must have one length");
            goto done;
        }
    }
    Py_ssize_t skipped = kind == 'f'
        ? mamba_ext_API->adamw_step_f32(w, m, v, g, n, lr, b1, b2, eps, wd, 0.0, step, 1.0, 1)
        : mamba_ext_API->adamw_step_f64(w, m, v, g, n, lr, b1, b2, eps, wd, 0.0, step, 1.0, 1);
    result = PyLong_FromSsize_t(skipped);
done:
    bufset_release(&s);
    return result;
}

/* scan_forward_backward((B, L, D, N), ld_bc, discretization, u, delta, BC, A_log,
 *                       D_vec, dy, y, grads[5]) -> hstates_len
 * BC: (B*L, ld_bc) rows holding Bs in columns [0, N) and Cs in [N, 2N);
 * y (B, L, D) written; grads = (du, ddelta, dBC, dA_log, dD_vec) +=. */
static PyObject *scan_forward_backward(PyObject *self, PyObject *args)
{
    Py_ssize_t B, L, D, N, ld_bc;
    int disc;
    PyObject *u_o, *delta_o, *bc_o, *alog_o, *dvec_o, *dy_o, *y_o, *g_o;
    if (!PyArg_ParseTuple(args, "(nnnn)niOOOOOOOO", &B, &L, &D, &N, &ld_bc, &disc, &u_o,
                          &delta_o, &bc_o, &alog_o, &dvec_o, &dy_o, &y_o, &g_o))
        return NULL;
    bufset s = {.n = 0};
    PyObject *result = NULL;
    void *hstates = NULL, *g[5];
    char kind = 'f';
    void *u = bufset_get(&s, u_o, 'f', 0, "u");
    if (u == NULL) {
        PyErr_Clear();
        kind = 'd';
        if ((u = bufset_get(&s, u_o, 'd', 0, "u")) == NULL)
            goto done;
    }
    size_t item = kind == 'f' ? sizeof(float) : sizeof(double);
    void *delta = bufset_get(&s, delta_o, kind, 0, "delta");
    void *bc = delta ? bufset_get(&s, bc_o, kind, 0, "BC") : NULL;
    void *alog = bc ? bufset_get(&s, alog_o, kind, 0, "A_log") : NULL;
    void *dvec = alog ? bufset_get(&s, dvec_o, kind, 0, "D_vec") : NULL;
    void *dy = dvec ? bufset_get(&s, dy_o, kind, 0, "dy") : NULL;
    void *y = dy ? bufset_get(&s, y_o, kind, 1, "y") : NULL;
    if (y == NULL || bufset_list(&s, g_o, 5, kind, 1, g, "grads") < 0)
        goto done;
    Py_ssize_t n_bld = B * L * D * (Py_ssize_t)item, n_bc = B * L * ld_bc * (Py_ssize_t)item;
    if (s.view[0].len != n_bld || s.view[1].len != n_bld || s.view[2].len != n_bc ||
        s.view[3].len != D * N * (Py_ssize_t)item || s.view[4].len != D * (Py_ssize_t)item ||
        s.view[5].len != n_bld || s.view[6].len != n_bld || s.view[7].len != n_bld ||
        s.view[8].len != n_bld || s.view[9].len != n_bc || s.view[10].len != s.view[3].len ||
        s.view[11].len != s.view[4].len || ld_bc < 2 * N) {
        PyErr_SetString(PyExc_ValueError, "scan buffers do not match the sizes");
        goto done;
    }
    Py_ssize_t n_h = mamba_ext_API->scan_hstates_len(B, L, D, N);
    if (n_h <= 0 || (hstates = malloc((size_t)n_h * item)) == NULL) {
        PyErr_SetString(PyExc_MemoryError, "hstates");
        goto done;
    }
    int r;
    if (kind == 'f') {
        const float *Bs = bc, *Cs = (const float *)bc + N;
        float *dBC = g[2];
        r = mamba_ext_API->scan_forward_f32(y, hstates, u, delta, Bs, Cs, ld_bc, alog, dvec,
                                            B, L, D, N, disc, 2);
        if (r == MAMBA_EXT_OK)
            r = mamba_ext_API->scan_backward_f32(g[0], g[1], dBC, dBC + N, g[3], g[4], dy,
                                                 hstates, u, delta, Bs, Cs, ld_bc, alog,
                                                 dvec, B, L, D, N, disc, 2);
    } else {
        const double *Bs = bc, *Cs = (const double *)bc + N;
        double *dBC = g[2];
        r = mamba_ext_API->scan_forward_f64(y, hstates, u, delta, Bs, Cs, ld_bc, alog, dvec,
                                            B, L, D, N, disc, 2);
        if (r == MAMBA_EXT_OK)
            r = mamba_ext_API->scan_backward_f64(g[0], g[1], dBC, dBC + N, g[3], g[4], dy,
                                                 hstates, u, delta, Bs, Cs, ld_bc, alog,
                                                 dvec, B, L, D, N, disc, 2);
    }
    if (r != MAMBA_EXT_OK) {
        status_error(r, "scan forward/backward");
        goto done;
    }
    result = PyLong_FromSsize_t(n_h);
done:
    free(hstates);
    bufset_release(&s);
    return result;
}

/* bad_calls() -> dict of status codes of calls with invalid arguments; every
 * one must be rejected (MAMBA_EXT_ERR_ARG, cache length 0), none may crash. */
static PyObject *bad_calls(PyObject *self, PyObject *args)
{
    mamba_ext_dims d = {2, 3, 4, 8, 2, 2, 1, 1e-6, 0};
    mamba_ext_dims zero = d, bad_disc = d;
    zero.L = 0;
    bad_disc.discretization = 7;
    float buf[4096] = {0};
    const float *params[MAMBA_EXT_NPARAMS];
    float *grads[MAMBA_EXT_NPARAMS];
    for (int i = 0; i < MAMBA_EXT_NPARAMS; i++) {
        params[i] = buf;
        grads[i] = buf;
    }
    const float *params_hole[MAMBA_EXT_NPARAMS];
    memcpy(params_hole, params, sizeof params);
    params_hole[MAMBA_EXT_P_A_log] = NULL;
    const mamba_ext_api *A = mamba_ext_API;
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:n,s:n,s:n,s:i,s:i,s:i}",
        "cache_len_null", A->block_cache_len(NULL),
        "cache_len_zero", A->block_cache_len(&zero),
        "cache_len_bad_disc", A->block_cache_len(&bad_disc),
        "forward_null_dims", A->block_forward_f32(buf, buf, buf, params, NULL, 1),
        "forward_zero_size", A->block_forward_f32(buf, buf, buf, params, &zero, 1),
        "forward_null_out", A->block_forward_f32(NULL, buf, buf, params, &d, 1),
        "forward_null_param", A->block_forward_f32(buf, buf, buf, params_hole, &d, 1),
        "forward_zero_threads", A->block_forward_f32(buf, buf, buf, params, &d, 0),
        "backward_null_cache", A->block_backward_f32(buf, grads, buf, NULL, params, &d, 1),
        "backward_null_grads", A->block_backward_f32(buf, NULL, buf, buf, params, &d, 1),
        "adamw_null", A->adamw_step_f32(NULL, buf, buf, buf, 4, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0, 1, 1.0, 1),
        "adamw_step0", A->adamw_step_f32(buf, buf, buf, buf, 4, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0, 0, 1.0, 1),
        "hstates_len_zero", A->scan_hstates_len(2, 0, 4, 2),
        "scan_ld_too_small", A->scan_forward_f32(buf, buf, buf, buf, buf, buf, 1, buf, buf, 2, 3, 4, 2, 0, 1),
        "scan_null_y", A->scan_forward_f32(NULL, buf, buf, buf, buf, buf, 2, buf, buf, 2, 3, 4, 2, 0, 1),
        "scan_bwd_null", A->scan_backward_f32(buf, buf, buf, buf, NULL, buf, buf, buf, buf, buf, buf, buf, 2, buf, buf, 2, 3, 4, 2, 0, 1));
}

/* table_entries() -> list of `count` bools: entry i of the table is set (non-NULL).
 * The entries are function pointers laid out one after the other from
 * block_cache_len on (checked against sizeof below), so they are read as an array
 * of raw pointer-sized words: no list of entry names is written here. */
static PyObject *table_entries(PyObject *self, PyObject *args)
{
    (void)self; (void)args;
    const mamba_ext_api *api = mamba_ext_API;
    typedef void (*fn_t)(void);
    size_t first = offsetof(mamba_ext_api, block_cache_len);
    if (api == NULL || sizeof(mamba_ext_api) != first + (size_t)MAMBA_EXT_API_COUNT * sizeof(fn_t)) {
        PyErr_SetString(PyExc_RuntimeError, "unexpected mamba_ext_api layout");
        return NULL;
    }
    PyObject *out = PyList_New(api->count);
    if (out == NULL)
        return NULL;
    for (int i = 0; i < api->count; i++) {
        fn_t f;
        memcpy(&f, (const char *)api + first + (size_t)i * sizeof(fn_t), sizeof f);
        PyList_SET_ITEM(out, i, PyBool_FromLong(f != NULL));
    }
    return out;
}

static PyMethodDef methods[] = {
    {"table_entries", table_entries, METH_NOARGS, NULL},
    {"api_info", api_info, METH_NOARGS, NULL},
    {"load_api", load_api, METH_VARARGS, NULL},
    {"block_forward_backward", block_forward_backward, METH_VARARGS, NULL},
    {"model_loss_and_grads", model_loss_and_grads, METH_VARARGS, NULL},
    {"adamw_step", adamw_step, METH_VARARGS, NULL},
    {"scan_forward_backward", scan_forward_backward, METH_VARARGS, NULL},
    {"bad_calls", bad_calls, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "capi_client",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit_capi_client(void)
{
    if (import_mamba_ext() < 0)
        return NULL;
    return PyModule_Create(&moduledef);
}
