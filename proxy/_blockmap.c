/* An insertion-ordered map from 64-bit integer keys to atomic values: the prefix index's tables
 * in C (proxy/routing/blockmap.py).
 *
 * The in-process prefix index keeps, per backend, the block hashes its engine holds in least
 * recently used order, the ones it trimmed lately, and for every block the set of its holders.
 * In dicts each (block, backend) entry cost ~160 bytes: the hash as an int object (40), a dict
 * entry with its share of the hash index (~45) in the LRU and again in the holder table, and a
 * mask int. Here an entry is 16 bytes (the key as a machine word, the value as a pointer) in an
 * array kept in insertion order, plus a 4-byte position in an open-addressed index one and a
 * half times the array: ~30 bytes with the slack growth leaves.
 *
 * The contract is proxy/routing/blockmap.py's PyBlockMap: a dict restricted to int keys in
 * [-2**63, 2**64) and int, float or None values, with front(n), first_value() and last_key()
 * for the ends of the order. tests/test_blockmap.py runs the two side by side on generated
 * operation sequences. Values are atomic (no references back to a container), so the type
 * takes no part in garbage collection: a GC pass over millions of entries would cost more
 * than the index's own work.
 *
 * Built by setup.py beside the mypyc-compiled hot path, and chosen with it (proxy/__init__.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t key;
    uintptr_t value; /* PyObject * | NEG; 0 once deleted */
} Entry;

#define NEG ((uintptr_t)1) /* the key was negative (stored as its two's complement) */
#define VALUE(e) ((PyObject *)((e)->value & ~NEG))
#define EMPTY 0u /* index slot never used since the last rebuild */
#define DUMMY 1u /* index slot whose entry was deleted; other slots hold position + 2 */
#define MIN_CAP 8

typedef struct {
    PyObject_HEAD
    Entry *entries;  /* insertion order; deleted ones stay until a rebuild */
    Py_ssize_t n;     /* entries written */
    Py_ssize_t cap;   /* entries allocated */
    Py_ssize_t used;  /* entries live */
    Py_ssize_t first; /* no live entry before this position */
    uint32_t *slots;  /* the open-addressed index, nslots long (NULL while cap is 0) */
    size_t nslots;
} BlockMap;

static PyTypeObject BlockMapType;
static PyObject *TWO_TO_64; /* the first key too large */

/* Key conversion: 0 with *key, *neg set; 1 for an int the map cannot hold (no error set);
 * -1 with an error set (not an int). */
static int
as_key(PyObject *o, uint64_t *key, uintptr_t *neg)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "a BlockMap's keys are ints, not %.100s",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000
    /* Up to 3.11 an int is its sign and digit count in ob_size and its digits: read them. */
    Py_ssize_t size = Py_SIZE(o);
    if (size >= 0) {
        const digit *d = ((PyLongObject *)o)->ob_digit;
        uint64_t x = 0;
        for (Py_ssize_t i = size - 1; i >= 0; i--) {
            if (x >> (64 - PyLong_SHIFT)) {
                return 1; /* 2**64 and up */
            }
            x = (x << PyLong_SHIFT) | d[i];
        }
        *key = x;
        *neg = 0;
        return 0;
    }
#endif
    /* Digit loops, no exception: PyLong_AsUnsignedLongLong goes through a byte array. */
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        *key = (uint64_t)v;
        *neg = v < 0 ? NEG : 0;
        return 0;
    }
    if (overflow < 0) {
        return 1; /* below -2**63 */
    }
    int below = PyObject_RichCompareBool(o, TWO_TO_64, Py_LT); /* 2**63 and up: half of them */
    if (below <= 0) {
        return below < 0 ? -1 : 1;
    }
    *key = (uint64_t)PyLong_AsUnsignedLongLongMask(o);
    *neg = 0;
    return 0;
}

static PyObject *
key_object(const Entry *e)
{
    if (e->value & NEG) {
        return PyLong_FromLongLong((long long)e->key);
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)e->key);
}

static int
check_value(PyObject *v)
{
    if (v == Py_None || PyLong_Check(v) || PyFloat_Check(v)) {
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "a BlockMap's values are int, float or None, not %.100s",
                 Py_TYPE(v)->tp_name);
    return -1;
}

/* The key's home slot: its bits mixed (test keys are small and consecutive), then mapped onto
 * [0, nslots) by a multiply, so the index need not be a power of two long. */
static size_t
home(uint64_t k, size_t nslots)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
#ifdef __SIZEOF_INT128__
    return (size_t)(((unsigned __int128)k * nslots) >> 64);
#else
    return (size_t)(k % nslots);
#endif
}

/* The position of the key's entry, or -1. *where: the slot that holds it, else the slot a new
 * entry for it takes (the first dummy on its probe path, or the empty slot that ends it). */
static Py_ssize_t
find(const BlockMap *m, uint64_t key, uintptr_t neg, size_t *where)
{
    if (m->slots == NULL) {
        *where = 0;
        return -1;
    }
    size_t i = home(key, m->nslots), free = SIZE_MAX;
    for (;;) {
        uint32_t s = m->slots[i];
        if (s == EMPTY) {
            *where = free != SIZE_MAX ? free : i;
            return -1;
        }
        if (s == DUMMY) {
            if (free == SIZE_MAX) {
                free = i;
            }
        }
        else {
            const Entry *e = &m->entries[s - 2];
            if (e->key == key && (e->value & NEG) == neg) {
                *where = i;
                return (Py_ssize_t)(s - 2);
            }
        }
        if (++i == m->nslots) {
            i = 0;
        }
    }
}

/* Drop deleted entries (the order of the live ones kept) and size the arrays for `need` live
 * entries: 1.5 times `need` when at least three quarters of the array would be live, or less
 * than a quarter (a bound lowered: the room goes back), else the same array compacted; the
 * index is 1.5 times the array or more (at most two thirds full, dummies included, which
 * linear probing needs, so a probe always ends at an empty slot). Out of memory, the map is
 * as it was (growing) or keeps its larger arrays (shrinking). */
static int
rebuild(BlockMap *m, Py_ssize_t need)
{
    Py_ssize_t cap = m->cap;
    if (need > cap || need * 4 > cap * 3 || need * 4 < cap) {
        cap = need + need / 2;
        if (cap < MIN_CAP) {
            cap = MIN_CAP;
        }
    }
    if (cap > (Py_ssize_t)(UINT32_MAX / 2) - 2) {
        PyErr_SetString(PyExc_OverflowError, "a BlockMap holds fewer than 2**31 entries");
        return -1;
    }
    /* What can fail comes before anything changes: a larger index and a larger array. */
    size_t nslots = (size_t)cap + (size_t)cap / 2 + 1;
    uint32_t *slots = NULL;
    if (nslots > m->nslots) {
        slots = PyMem_Calloc(nslots, sizeof(uint32_t));
        if (slots == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    if (cap > m->cap) {
        Entry *entries = PyMem_Realloc(m->entries, (size_t)cap * sizeof(Entry));
        if (entries == NULL) {
            PyMem_Free(slots);
            PyErr_NoMemory();
            return -1;
        }
        m->entries = entries;
        m->cap = cap;
    }
    Py_ssize_t live = 0;
    for (Py_ssize_t i = m->first; i < m->n; i++) {
        if (m->entries[i].value) {
            m->entries[live++] = m->entries[i];
        }
    }
    m->n = live;
    m->first = 0;
    if (cap < m->cap) { /* a smaller array: if the allocator cannot, the larger one stays */
        Entry *entries = PyMem_Realloc(m->entries, (size_t)cap * sizeof(Entry));
        if (entries != NULL) {
            m->entries = entries;
            m->cap = cap;
        }
    }
    if (slots == NULL) { /* the same index, or a smaller one for the array kept */
        size_t want = (size_t)m->cap + (size_t)m->cap / 2 + 1;
        if (want < m->nslots && (slots = PyMem_Calloc(want, sizeof(uint32_t))) != NULL) {
            PyMem_Free(m->slots);
            m->slots = slots;
            m->nslots = want;
        }
        else {
            memset(m->slots, 0, m->nslots * sizeof(uint32_t));
        }
    }
    else {
        PyMem_Free(m->slots);
        m->slots = slots;
        m->nslots = nslots;
    }
    for (Py_ssize_t p = 0; p < m->n; p++) {
        size_t i = home(m->entries[p].key, m->nslots);
        while (m->slots[i] != EMPTY) {
            if (++i == m->nslots) {
                i = 0;
            }
        }
        m->slots[i] = (uint32_t)(p + 2);
    }
    return 0;
}

/* A new entry at the back (the key is not in the map; `where` is what find said). */
static int
append(BlockMap *m, uint64_t key, uintptr_t neg, PyObject *value, size_t where)
{
    if (m->n == m->cap) {
        if (rebuild(m, m->used + 1) < 0) {
            return -1;
        }
        find(m, key, neg, &where);
    }
    Py_INCREF(value);
    Entry *e = &m->entries[m->n];
    e->key = key;
    e->value = (uintptr_t)value | neg;
    m->slots[where] = (uint32_t)(m->n + 2);
    m->n++;
    m->used++;
    return 0;
}

static void
advance_first(BlockMap *m)
{
    while (m->first < m->n && !m->entries[m->first].value) {
        m->first++;
    }
}

/* Delete the entry at `pos` (its slot `where`) and return its value's reference. */
static PyObject *
take(BlockMap *m, Py_ssize_t pos, size_t where)
{
    Entry *e = &m->entries[pos];
    PyObject *value = VALUE(e);
    e->value = 0;
    m->slots[where] = DUMMY;
    m->used--;
    if (m->used == 0) { /* empty: start over, every slot free again */
        m->n = m->first = 0;
        memset(m->slots, 0, m->nslots * sizeof(uint32_t));
    }
    else if (pos == m->first) {
        advance_first(m);
    }
    return value;
}

static PyObject *
BlockMap_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "BlockMap() takes no arguments");
        return NULL;
    }
    BlockMap *m = (BlockMap *)type->tp_alloc(type, 0);
    return (PyObject *)m; /* every field zero: empty */
}

static void
clear_entries(BlockMap *m)
{
    Entry *entries = m->entries;
    Py_ssize_t first = m->first, n = m->n;
    m->entries = NULL;
    m->n = m->cap = m->used = m->first = 0;
    PyMem_Free(m->slots);
    m->slots = NULL;
    m->nslots = 0;
    for (Py_ssize_t i = first; i < n; i++) {
        if (entries[i].value) {
            Py_DECREF(VALUE(&entries[i]));
        }
    }
    PyMem_Free(entries);
}

static void
BlockMap_dealloc(BlockMap *m)
{
    clear_entries(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t
BlockMap_len(BlockMap *m)
{
    return m->used;
}

/* Where the key object `k` is: its position (*where: its slot), -1 when absent (not an int, or
 * an int the map cannot hold: as a dict of such keys would answer), -2 with an error set. */
static Py_ssize_t
locate(const BlockMap *m, PyObject *k, size_t *where)
{
    uint64_t key;
    uintptr_t neg;
    if (!PyLong_Check(k)) {
        return -1;
    }
    int r = as_key(k, &key, &neg);
    if (r) {
        return r < 0 ? -2 : -1;
    }
    return find(m, key, neg, where);
}

static PyObject *
BlockMap_subscript(BlockMap *m, PyObject *k)
{
    size_t where;
    Py_ssize_t pos = locate(m, k, &where);
    if (pos < 0) {
        if (pos == -1) {
            PyErr_SetObject(PyExc_KeyError, k);
        }
        return NULL;
    }
    PyObject *v = VALUE(&m->entries[pos]);
    Py_INCREF(v);
    return v;
}

static int
BlockMap_ass_subscript(BlockMap *m, PyObject *k, PyObject *v)
{
    size_t where;
    if (v == NULL) { /* del m[k] */
        Py_ssize_t pos = locate(m, k, &where);
        if (pos < 0) {
            if (pos == -1) {
                PyErr_SetObject(PyExc_KeyError, k);
            }
            return -1;
        }
        Py_DECREF(take(m, pos, where));
        return 0;
    }
    uint64_t key;
    uintptr_t neg;
    int r = as_key(k, &key, &neg);
    if (r < 0) {
        return -1;
    }
    if (r) {
        PyErr_SetString(PyExc_OverflowError, "a BlockMap's keys are in [-2**63, 2**64)");
        return -1;
    }
    if (check_value(v) < 0) {
        return -1;
    }
    Py_ssize_t pos = find(m, key, neg, &where);
    if (pos >= 0) { /* as a dict: the value changes, the place does not */
        Entry *e = &m->entries[pos];
        PyObject *old = VALUE(e);
        Py_INCREF(v);
        e->value = (uintptr_t)v | neg;
        Py_DECREF(old);
        return 0;
    }
    return append(m, key, neg, v, where);
}

static int
BlockMap_contains(BlockMap *m, PyObject *k)
{
    size_t where;
    Py_ssize_t pos = locate(m, k, &where);
    return pos == -2 ? -1 : pos >= 0;
}

/* get and pop take a key and, optionally, a default. */
static int
positional(const char *name, Py_ssize_t nargs)
{
    if (nargs == 1 || nargs == 2) {
        return 1;
    }
    PyErr_Format(PyExc_TypeError, "%s expected 1 or 2 arguments, got %zd", name, nargs);
    return 0;
}

/* get(key, default=None, /) */
static PyObject *
BlockMap_get(BlockMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (!positional("get", nargs)) {
        return NULL;
    }
    size_t where;
    Py_ssize_t pos = locate(m, args[0], &where);
    if (pos == -2) {
        return NULL;
    }
    PyObject *v = pos >= 0 ? VALUE(&m->entries[pos]) : nargs == 2 ? args[1] : Py_None;
    Py_INCREF(v);
    return v;
}

/* pop(key[, default], /) */
static PyObject *
BlockMap_pop(BlockMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (!positional("pop", nargs)) {
        return NULL;
    }
    size_t where;
    Py_ssize_t pos = locate(m, args[0], &where);
    if (pos >= 0) {
        return take(m, pos, where);
    }
    if (pos == -2) {
        return NULL;
    }
    if (nargs == 2) {
        Py_INCREF(args[1]);
        return args[1];
    }
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

enum { KEYS, VALUES, ITEMS };

/* The first `want` (at most len) keys, values or (key, value) pairs, in insertion order. */
static PyObject *
listing(BlockMap *m, int what, Py_ssize_t want)
{
    PyObject *out = PyList_New(want);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t got = 0;
    for (Py_ssize_t i = m->first; i < m->n && got < want; i++) {
        const Entry *e = &m->entries[i];
        if (!e->value) {
            continue;
        }
        PyObject *item;
        if (what == VALUES) {
            item = VALUE(e);
            Py_INCREF(item);
        }
        else {
            PyObject *k = key_object(e);
            if (k == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            item = what == KEYS ? k : PyTuple_Pack(2, k, VALUE(e));
            if (what == ITEMS) {
                Py_DECREF(k);
                if (item == NULL) {
                    Py_DECREF(out);
                    return NULL;
                }
            }
        }
        PyList_SET_ITEM(out, got++, item);
    }
    return out;
}

/* front(n, /): the first n keys, least recently inserted first. */
static PyObject *
BlockMap_front(BlockMap *m, PyObject *arg)
{
    Py_ssize_t want = PyLong_AsSsize_t(arg);
    if (want == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return listing(m, KEYS, want < 0 ? 0 : want > m->used ? m->used : want);
}

static PyObject *
BlockMap_first_value(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    if (m->used == 0) {
        PyErr_SetString(PyExc_KeyError, "first_value(): the map is empty");
        return NULL;
    }
    PyObject *v = VALUE(&m->entries[m->first]); /* first is always live while used > 0 */
    Py_INCREF(v);
    return v;
}

static PyObject *
BlockMap_last_key(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    for (Py_ssize_t i = m->n - 1; i >= m->first; i--) {
        if (m->entries[i].value) {
            return key_object(&m->entries[i]);
        }
    }
    PyErr_SetString(PyExc_KeyError, "last_key(): the map is empty");
    return NULL;
}

static PyObject *
BlockMap_keys(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    return listing(m, KEYS, m->used);
}

static PyObject *
BlockMap_values(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    return listing(m, VALUES, m->used);
}

static PyObject *
BlockMap_items(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    return listing(m, ITEMS, m->used);
}

static PyObject *
BlockMap_iter(BlockMap *m)
{
    PyObject *keys = listing(m, KEYS, m->used); /* a snapshot: the map may change while it is walked */
    if (keys == NULL) {
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *
BlockMap_clear(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    clear_entries(m);
    Py_RETURN_NONE;
}

static PyObject *
BlockMap_sizeof(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    size_t size = Py_TYPE(m)->tp_basicsize + (size_t)m->cap * sizeof(Entry) +
                  m->nslots * sizeof(uint32_t);
    return PyLong_FromSize_t(size);
}

static PyObject *
BlockMap_repr(BlockMap *m)
{
    return PyUnicode_FromFormat("<BlockMap of %zd entries>", m->used);
}

static PyMethodDef BlockMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))BlockMap_get, METH_FASTCALL,
     "get(key, default=None, /): the key's value, else default."},
    {"pop", (PyCFunction)(void (*)(void))BlockMap_pop, METH_FASTCALL,
     "pop(key[, default], /): remove the key and return its value (else default or KeyError)."},
    {"front", (PyCFunction)BlockMap_front, METH_O,
     "front(n, /): the first n keys in insertion order."},
    {"first_value", (PyCFunction)BlockMap_first_value, METH_NOARGS,
     "The value of the first key in insertion order (KeyError when empty)."},
    {"last_key", (PyCFunction)BlockMap_last_key, METH_NOARGS,
     "The last key in insertion order (KeyError when empty)."},
    {"keys", (PyCFunction)BlockMap_keys, METH_NOARGS, "The keys in insertion order (a list)."},
    {"values", (PyCFunction)BlockMap_values, METH_NOARGS, "The values in order (a list)."},
    {"items", (PyCFunction)BlockMap_items, METH_NOARGS, "(key, value) pairs in order (a list)."},
    {"clear", (PyCFunction)BlockMap_clear, METH_NOARGS, "Remove every entry."},
    {"__sizeof__", (PyCFunction)BlockMap_sizeof, METH_NOARGS, "Bytes held, arrays included."},
    {"__class_getitem__", Py_GenericAlias, METH_O | METH_CLASS, "BlockMap[V] for annotations."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods BlockMap_mapping = {
    .mp_length = (lenfunc)BlockMap_len,
    .mp_subscript = (binaryfunc)BlockMap_subscript,
    .mp_ass_subscript = (objobjargproc)BlockMap_ass_subscript,
};

static PySequenceMethods BlockMap_sequence = {
    .sq_contains = (objobjproc)BlockMap_contains,
};

static PyTypeObject BlockMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "proxy._blockmap.BlockMap",
    .tp_doc = "An insertion-ordered map of 64-bit int keys to int, float or None values "
              "(proxy/routing/blockmap.py's PyBlockMap is the contract).",
    .tp_basicsize = sizeof(BlockMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = BlockMap_new,
    .tp_dealloc = (destructor)BlockMap_dealloc,
    .tp_repr = (reprfunc)BlockMap_repr,
    .tp_as_mapping = &BlockMap_mapping,
    .tp_as_sequence = &BlockMap_sequence,
    .tp_iter = (getiterfunc)BlockMap_iter,
    .tp_methods = BlockMap_methods,
    .tp_hash = PyObject_HashNotImplemented,
};

static struct PyModuleDef blockmap_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "proxy._blockmap",
    .m_doc = "The prefix index's tables in C (proxy/routing/blockmap.py).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__blockmap(void)
{
    if (PyType_Ready(&BlockMapType) < 0) {
        return NULL;
    }
    if (TWO_TO_64 == NULL) {
        PyObject *one = PyLong_FromLong(1), *shift = PyLong_FromLong(64);
        TWO_TO_64 = one && shift ? PyNumber_Lshift(one, shift) : NULL;
        Py_XDECREF(one);
        Py_XDECREF(shift);
        if (TWO_TO_64 == NULL) {
            return NULL;
        }
    }
    PyObject *m = PyModule_Create(&blockmap_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&BlockMapType);
    if (PyModule_AddObject(m, "BlockMap", (PyObject *)&BlockMapType) < 0) {
        Py_DECREF(&BlockMapType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
