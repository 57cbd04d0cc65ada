/* The run of common chat events in one upstream read, scanned in C (proxy/eventscan.py), and
 * the test the meter makes of each other chat event (jsonscan.chat_output).
 *
 * The stream meter classifies every event of every read. The common one (compact JSON, one
 * `data: ` line, non-empty content, no finish reason) needs four byte searches, and from
 * Python each is a bytes-method call that costs more in argument parsing than the search
 * itself: about a fifth of a paced chunk's instructions. Here one call skips the whole run of
 * such events and says where the first other event ends. proxy/eventscan.py's chat_events_py
 * is the same scan in Python, the fallback where this is not built and the reference the
 * tests compare this with; its docstring is the contract. chat_output's is jsonscan's: five
 * searches, each a bytes-method call from Python, for every event that is not common.
 *
 * Built by setup.py beside the mypyc-compiled hot path, and chosen with it (proxy/__init__.py).
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memmem */
#endif
#include <Python.h>
#include <string.h>

static const char DATA[] = "data: ";
#define DATA_LEN 6
static const char CONTENT[] = "\"content\":\"";
#define CONTENT_LEN 11
static const char FINISH[] = "\"finish_reason\":";
#define FINISH_LEN 16

/* Places where a needle's anchor byte matched and the rest did not, past which find hands
 * the rest of the range to memmem (linear whatever the bytes: a hostile read of anchors). */
#define FALSE_HITS 16

/* The first `needle` (1 or more bytes) wholly inside buf[from:to], or -1 (bytes.find's
 * answer). An event is ~150 bytes and glibc's memmem builds a shift table on every call:
 * ~700 instructions a search, three searches an event, ~5% of a paced chunk's instructions.
 * Here memchr finds each place of the needle's anchor byte (its first that is not a quote:
 * quotes are everywhere in JSON) and memcmp checks the needle there. */
static Py_ssize_t
find(const char *buf, Py_ssize_t from, Py_ssize_t to, const char *needle, Py_ssize_t len)
{
    if (to - from < len) {
        return -1;
    }
    Py_ssize_t a = (len > 1 && needle[0] == '"') ? 1 : 0;
    const char *p = buf + from + a;
    const char *last = buf + to - len + a; /* the anchor's last place that leaves room */
    for (int misses = 0; p <= last; misses++) {
        if (misses == FALSE_HITS) {
            const char *m = memmem(p - a, (size_t)(buf + to - (p - a)), needle, (size_t)len);
            return m == NULL ? -1 : (Py_ssize_t)(m - buf);
        }
        p = memchr(p, needle[a], (size_t)(last - p + 1));
        if (p == NULL) {
            return -1;
        }
        if (memcmp(p - a, needle, (size_t)len) == 0) {
            return (Py_ssize_t)(p - a - buf);
        }
        p++;
    }
    return -1;
}

static int
is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

/* jsonscan.value_starts(buf, FINISH, QUOTE, s, e): some finish_reason key in buf[s:e] whose
 * value, after whitespace, starts a string. The key cannot overlap itself, so looking at its
 * occurrences front to back finds the ones value_starts finds back to front. */
static int
finish_string(const char *buf, Py_ssize_t s, Py_ssize_t e)
{
    Py_ssize_t i = find(buf, s, e, FINISH, FINISH_LEN);
    while (i >= 0) {
        Py_ssize_t j = i + FINISH_LEN;
        while (j < e && is_ws(buf[j])) {
            j++;
        }
        if (j < e && buf[j] == '"') {
            return 1;
        }
        i = find(buf, j, e, FINISH, FINISH_LEN);
    }
    return 0;
}

static PyObject *
triple(Py_ssize_t a, Py_ssize_t b, Py_ssize_t c)
{
    PyObject *t = PyTuple_New(3);
    if (t == NULL) {
        return NULL;
    }
    Py_ssize_t v[3] = {a, b, c};
    for (int k = 0; k < 3; k++) {
        PyObject *x = PyLong_FromSsize_t(v[k]);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, k, x);
    }
    return t;
}

static Py_ssize_t
index_arg(PyObject *o, const char *name)
{
    Py_ssize_t v = PyLong_AsSsize_t(o);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "chat_events: %s must be >= 0, not %zd", name, v);
        return -1;
    }
    return v;
}

/* jsonscan.nonempty_at(p, key, opener): some `key` in p whose value, after whitespace, is a
 * non-empty string (opener '"') or a non-empty array (opener '['). */
static int
nonempty_at(const char *p, Py_ssize_t n, const char *key, Py_ssize_t k, char opener)
{
    Py_ssize_t i = find(p, 0, n, key, k);
    while (i >= 0) {
        Py_ssize_t j = i + k;
        while (j < n && is_ws(p[j])) {
            j++;
        }
        if (j + 1 < n && p[j] == opener) {
            j++;
            if (opener == '"') {
                if (p[j] != '"') {
                    return 1;
                }
            }
            else {
                while (j < n && is_ws(p[j])) {
                    j++;
                }
                if (j < n && p[j] != ']') {
                    return 1;
                }
            }
        }
        i = find(p, j, n, key, k);
    }
    return 0;
}

#define KEY(s) s, (Py_ssize_t)(sizeof(s) - 1)

/* jsonscan.chat_output(p): does a chat chunk carry output in any choice? */
static PyObject *
chat_output(PyObject *module, PyObject *arg)
{
    (void)module;
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "chat_output: p must be bytes");
        return NULL;
    }
    const char *p = PyBytes_AS_STRING(arg);
    Py_ssize_t n = PyBytes_GET_SIZE(arg);
    int out = nonempty_at(p, n, KEY("\"content\":"), '"')
              || nonempty_at(p, n, KEY("\"reasoning_content\":"), '"')
              || nonempty_at(p, n, KEY("\"reasoning\":"), '"')
              || nonempty_at(p, n, KEY("\"refusal\":"), '"')
              || nonempty_at(p, n, KEY("\"tool_calls\":"), '[');
    return PyBool_FromLong(out);
}

static PyObject *
chat_events(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError,
                     "chat_events(buf, start, search, sep) takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyBytes_Check(args[0]) || !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "chat_events: buf and sep must be bytes");
        return NULL;
    }
    Py_ssize_t start = index_arg(args[1], "start");
    if (start < 0) {
        return NULL;
    }
    Py_ssize_t search = index_arg(args[2], "search");
    if (search < 0) {
        return NULL;
    }
    const char *buf = PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    const char *sep = PyBytes_AS_STRING(args[3]);
    Py_ssize_t seplen = PyBytes_GET_SIZE(args[3]);
    if (seplen == 0) {
        PyErr_SetString(PyExc_ValueError, "chat_events: empty separator");
        return NULL;
    }
    Py_ssize_t k = 0;
    while (search < n) {
        Py_ssize_t end = find(buf, search, n, sep, seplen);
        if (end < 0) {
            break;
        }
        if (end - start < DATA_LEN || memcmp(buf + start, DATA, DATA_LEN) != 0) {
            return triple(k, start, end);
        }
        Py_ssize_t i = find(buf, start + DATA_LEN, end, CONTENT, CONTENT_LEN);
        /* i + CONTENT_LEN <= end < n: the byte after the key's quote is in buf */
        if (i < 0 || buf[i + CONTENT_LEN] == '"' || finish_string(buf, start + DATA_LEN, end)) {
            return triple(k, start, end);
        }
        k++;
        start = search = end + seplen;
    }
    return triple(k, start, -1);
}

static PyMethodDef methods[] = {
    {"chat_events", (PyCFunction)(void (*)(void))chat_events, METH_FASTCALL,
     "chat_events(buf, start, search, sep) -> (count, start, end): as "
     "proxy.eventscan.chat_events_py."},
    {"chat_output", chat_output, METH_O,
     "chat_output(p) -> bool: as proxy.jsonscan.chat_output."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "proxy._eventscan",
    .m_doc = "The meter's event scans in C (proxy/eventscan.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__eventscan(void)
{
    return PyModule_Create(&module_def);
}
