/* Recording's and planning's common calls in C, with the results of the Python code.
 *
 * Three types and a function:
 * - Recorder: one per fold (``fold._recorder``), holding its tape lists (depth, source, index:
 *   see torchfold.engine.node.Tape), its groups dict and a cache of the groups found lately.
 * - FastAdd: what ``Fold.add`` is when this module is built. It wraps the Python ``Fold.add``
 *   and binds to a fold as a function does (``fold.add`` is a bound method: no reference
 *   cycle, a fold is freed as soon as it is dropped). A call of two, four or one nodes of
 *   the fold (binary trees, a binary LSTM cell, chains), or of one int (a leaf), into a group
 *   that already exists, is recorded here; any other call goes to the Python ``Fold.add``,
 *   which makes every new group and every error message.
 * - FastSplit: what ``Node.split`` is when this module is built, the same kind of wrapper around
 *   the Python ``Node.split``. Splitting a node of a group whose outputs are known already (every
 *   split but a group's first) is done here; anything else goes to the Python ``split``.
 * - plain_group: what the planner (torchfold.engine.planner) makes of a group whose every
 *   argument is a batched node: its whole results and its gathers.
 * Nodes, tapes and groups are the Python classes; their slots are read and written at the
 * offsets their member descriptors give. Python code reaches all of it through
 * torchfold.engine.native.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>

#define SLOT(object, offset) (*(PyObject **)((char *)(object) + (offset)))

/* Groups found lately, by (op, depth, arity), for ops whose hash and equality cannot change (a
 * str, a plain function). A fold never removes a group from its dict nor replaces the dict
 * (`_groups`), its tape or the tape's lists; a group also stays alive in `tape.source_group`.
 * An entry holds its op, so that no other op can take its address while it is here. */
#define CACHE_SIZE 64

typedef struct {
    PyObject *op; /* a strong reference (NULL: empty) */
    Py_ssize_t depth, count;
    PyObject *group; /* borrowed from the groups dict, which never drops a group */
} CacheEntry;

typedef struct {
    PyObject_HEAD
    PyObject *ref;    /* tape.ref: the weak reference to the fold's Tape that its nodes hold (NULL: unusable) */
    PyObject *depth;  /* tape.depth: list of int */
    PyObject *source; /* tape.source: list of int */
    PyObject *index;  /* tape.index: list of int */
    PyObject *groups; /* Fold._groups: dict (depth, op, count) -> Group */
    PyTypeObject *node_type, *group_type;
    Py_ssize_t node_ref, node_handle;     /* offsets of Node._ref, Node._handle */
    Py_ssize_t group_nodes, group_source; /* offsets of Group.nodes, Group.source */
    CacheEntry cache[CACHE_SIZE];
} Recorder;

static PyTypeObject RecorderType;

/* The offset of the object slot `name` of `type` (a class with __slots__), or -1 with an error. */
static Py_ssize_t
slot_offset(PyTypeObject *type, const char *name)
{
    PyObject *descr = PyObject_GetAttrString((PyObject *)type, name);
    if (descr == NULL) {
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type) && PyType_IsSubtype(type, PyDescr_TYPE(descr))) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type == T_OBJECT_EX && !(member->flags & READONLY)) {
            offset = member->offset;
        }
    }
    Py_DECREF(descr);
    if (offset < 0) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object slot", type->tp_name, name);
    }
    return offset;
}

/* 0 if `type` can be the type of the nodes made here (new_node untracks them: it must support
 * the garbage collector, as every class defined in Python does), else -1 with a TypeError. */
static int
check_node_type(const char *where, PyTypeObject *type)
{
    if (!PyType_IS_GC(type)) {
        PyErr_Format(PyExc_TypeError, "%s: node_type %s does not support the garbage collector", where,
                     type->tp_name);
        return -1;
    }
    return 0;
}

/* What the weak reference `ref` refers to (a new reference), or NULL (no error set) when it is gone. */
static PyObject *
referent(PyObject *ref)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *object;
    if (PyWeakref_GetRef(ref, &object) <= 0) {
        PyErr_Clear();
        return NULL;
    }
    return object;
#else
    PyObject *object = PyWeakref_GET_OBJECT(ref);
    return object == Py_None ? NULL : Py_NewRef(object);
#endif
}

/* A new node of `type` holding `ref` (its tape's weak reference) and `handle` (stolen), or NULL
 * with an error. The garbage collector does not track it: a node holds an int and a weak
 * reference, nothing through which a cycle could come back to it, and a fold's nodes are many. */
static PyObject *
new_node(PyTypeObject *type, Py_ssize_t ref_slot, PyObject *ref, Py_ssize_t handle_slot, PyObject *handle)
{
    PyObject *node = type->tp_alloc(type, 0);
    if (node == NULL) {
        Py_DECREF(handle);
        return NULL;
    }
    PyObject_GC_UnTrack(node);
    SLOT(node, ref_slot) = Py_NewRef(ref);
    SLOT(node, handle_slot) = handle;
    return node;
}

/* A list attribute of `tape` (a new reference), or NULL with an error. */
static PyObject *
tape_list(PyObject *tape, const char *name)
{
    PyObject *list = PyObject_GetAttrString(tape, name);
    if (list != NULL && !PyList_CheckExact(list)) {
        PyErr_Format(PyExc_TypeError, "tape.%s must be a list", name);
        Py_CLEAR(list);
    }
    return list;
}

/* Empty the group cache (its entries' ops are strong references). */
static void
clear_cache(Recorder *self)
{
    for (int i = 0; i < CACHE_SIZE; i++) {
        Py_CLEAR(self->cache[i].op);
    }
}

static int
Recorder_init(Recorder *self, PyObject *args, PyObject *kwds)
{
    static char *keywords[] = {"tape", "groups", "node_type", "group_type", NULL};
    PyObject *tape, *groups;
    PyTypeObject *node_type, *group_type;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!O!:Recorder", keywords, &tape, &PyDict_Type, &groups,
                                     &PyType_Type, &node_type, &PyType_Type, &group_type) ||
        check_node_type("Recorder", node_type) < 0) {
        return -1;
    }
    PyObject *depth = tape_list(tape, "depth");
    PyObject *source = depth ? tape_list(tape, "source") : NULL;
    PyObject *index = source ? tape_list(tape, "index") : NULL;
    PyObject *ref = index ? PyObject_GetAttrString(tape, "ref") : NULL;
    PyObject *referred = ref != NULL && PyWeakref_CheckRefExact(ref) ? referent(ref) : NULL;
    Py_XDECREF(referred); /* (only compared) */
    if (ref != NULL && referred != tape) {
        PyErr_SetString(PyExc_TypeError, "tape.ref must be weakref.ref(tape)");
        Py_CLEAR(ref);
    }
    if (ref == NULL) {
        Py_XDECREF(depth);
        Py_XDECREF(source);
        Py_XDECREF(index);
        return -1;
    }
    clear_cache(self); /* (a second __init__: its groups are other groups) */
    Py_XSETREF(self->depth, depth);
    Py_XSETREF(self->source, source);
    Py_XSETREF(self->index, index);
    Py_XSETREF(self->ref, ref);
    Py_XSETREF(self->groups, Py_NewRef(groups));
    Py_XSETREF(self->node_type, (PyTypeObject *)Py_NewRef((PyObject *)node_type));
    Py_XSETREF(self->group_type, (PyTypeObject *)Py_NewRef((PyObject *)group_type));
    if ((self->node_ref = slot_offset(node_type, "_ref")) < 0 ||
        (self->node_handle = slot_offset(node_type, "_handle")) < 0 ||
        (self->group_nodes = slot_offset(group_type, "nodes")) < 0 ||
        (self->group_source = slot_offset(group_type, "source")) < 0) {
        Py_CLEAR(self->ref); /* not usable: FastAdd leaves every call to Python */
        return -1;
    }
    return 0;
}

static int
Recorder_traverse(Recorder *self, visitproc visit, void *arg)
{
    for (int i = 0; i < CACHE_SIZE; i++) {
        Py_VISIT(self->cache[i].op);
    }
    Py_VISIT(self->ref);
    Py_VISIT(self->depth);
    Py_VISIT(self->source);
    Py_VISIT(self->index);
    Py_VISIT(self->groups);
    Py_VISIT(self->node_type);
    Py_VISIT(self->group_type);
    return 0;
}

static int
Recorder_clear(Recorder *self)
{
    clear_cache(self);
    Py_CLEAR(self->ref);
    Py_CLEAR(self->depth);
    Py_CLEAR(self->source);
    Py_CLEAR(self->index);
    Py_CLEAR(self->groups);
    Py_CLEAR(self->node_type);
    Py_CLEAR(self->group_type);
    return 0;
}

static void
Recorder_dealloc(Recorder *self)
{
    PyObject_GC_UnTrack(self);
    Recorder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The handle of `arg` if it is a node of this fold (borrowed), else NULL (no error set). */
static PyObject *
own_handle(Recorder *self, PyObject *arg)
{
    if (Py_TYPE(arg) != self->node_type || SLOT(arg, self->node_ref) != self->ref) {
        return NULL;
    }
    PyObject *handle = SLOT(arg, self->node_handle);
    return handle != NULL && PyLong_CheckExact(handle) ? handle : NULL;
}

/* `value` as a C integer >= 0, or -1 (no error set) when it is not one. */
static Py_ssize_t
as_row(PyObject *value)
{
    Py_ssize_t row = PyLong_CheckExact(value) ? PyLong_AsSsize_t(value) : -1;
    if (row < 0) {
        PyErr_Clear();
        return -1;
    }
    return row;
}

/* `value` (an int) as a C integer, or -1 with no error set when it is not an int >= 0 or is
 * `limit` or more. */
static Py_ssize_t
as_index(PyObject *value, Py_ssize_t limit)
{
    Py_ssize_t row = as_row(value);
    return row < limit ? row : -1;
}

/* depth[handle] as a C integer, or -1 (no error set) when it is not one of the tape's rows. */
static Py_ssize_t
depth_of(Recorder *self, PyObject *handle)
{
    Py_ssize_t row = as_index(handle, PyList_GET_SIZE(self->depth));
    return row < 0 ? -1 : as_row(PyList_GET_ITEM(self->depth, row));
}

/* The group of (op, depth, count) if it exists (a new reference), else NULL (no error set).
 * It may run the op's __hash__ and __eq__ (Python code), unless the op is in the cache: only
 * ops whose hash and equality cannot change are cached (a str, a plain function). */
static PyObject *
find_group(Recorder *self, PyObject *op, Py_ssize_t depth, Py_ssize_t count, PyObject *depth_value)
{
    int cached = PyUnicode_CheckExact(op) || PyFunction_Check(op);
    CacheEntry *entry =
        &self->cache[(((uintptr_t)op >> 4) ^ ((uintptr_t)depth * 31u) ^ (uintptr_t)count) % CACHE_SIZE];
    if (cached && entry->op == op && entry->depth == depth && entry->count == count) {
        return Py_NewRef(entry->group);
    }
    PyObject *count_value = PyLong_FromSsize_t(count);
    PyObject *where = count_value ? PyTuple_Pack(3, depth_value, op, count_value) : NULL;
    Py_XDECREF(count_value);
    PyObject *group = where ? PyDict_GetItemWithError(self->groups, where) : NULL;
    Py_XDECREF(where);
    if (group == NULL || !Py_IS_TYPE(group, self->group_type)) {
        PyErr_Clear(); /* a new group, an op that is not hashable, not a group: the Python add */
        return NULL;
    }
    if (cached) {
        Py_XSETREF(entry->op, Py_NewRef(op));
        entry->depth = depth;
        entry->count = count;
        entry->group = group;
    }
    return Py_NewRef(group);
}

/* Append a new reference to `list`, stealing it; -1 with an error on failure. */
static int
append_new(PyObject *list, PyObject *item)
{
    if (item == NULL) {
        return -1;
    }
    int failed = PyList_Append(list, item);
    Py_DECREF(item);
    return failed;
}

/* Returned by record() for a call it leaves to the Python add. */
#define NOT_HANDLED ((PyObject *)&RecorderType)

/* Record op(*items): the new node (a new reference), NULL with an error, or NOT_HANDLED. */
static PyObject *
record(Recorder *self, PyObject *op, PyObject *const *items, Py_ssize_t count)
{
    PyObject *handles[4];
    Py_ssize_t depth = 0;
    if (count == 1 && PyLong_CheckExact(items[0])) {
        int overflow = 0;
        (void)PyLong_AsLongLongAndOverflow(items[0], &overflow);
        if (overflow) { /* outside int64: the Python add names it */
            return NOT_HANDLED;
        }
        handles[0] = items[0]; /* a leaf: its key is its argument */
    }
    else if (count == 1 || count == 2 || count == 4) {
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *handle = own_handle(self, items[i]);
            Py_ssize_t below = handle ? depth_of(self, handle) : -1;
            if (below < 0) {
                return NOT_HANDLED;
            }
            handles[i] = handle;
            if (below >= depth) {
                depth = below + 1;
            }
        }
    }
    else {
        return NOT_HANDLED;
    }
    /* The key holds its own references now: the lookup below may run Python code (an op's
     * __hash__ and __eq__, a tensor key's __eq__) that changes or drops the argument nodes. */
    PyObject *key = PyTuple_New(count);
    if (key == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyTuple_SET_ITEM(key, i, Py_NewRef(handles[i]));
    }
    PyObject *depth_value = PyLong_FromSsize_t(depth);
    if (depth_value == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *result = NOT_HANDLED, *nodes = NULL, *group_source = NULL, *fresh = NULL, *handle = NULL;
    PyObject *group = find_group(self, op, depth, count, depth_value);
    if (group != NULL) {
        nodes = SLOT(group, self->group_nodes);
        group_source = SLOT(group, self->group_source);
        Py_XINCREF(nodes);
        Py_XINCREF(group_source);
    }
    if (nodes == NULL || !PyDict_CheckExact(nodes) || group_source == NULL) {
        goto done; /* a new group: the Python add */
    }
    result = NULL;
    fresh = PyLong_FromSsize_t(PyList_GET_SIZE(self->depth));
    if (fresh == NULL) {
        goto done;
    }
    handle = PyDict_SetDefault(nodes, key, fresh); /* a new call, or an identical one */
    if (handle == NULL) {
        goto done;
    }
    Py_INCREF(handle); /* (borrowed from the dict, which Python code could change from here on) */
    if (handle == fresh) {
        if (append_new(self->index, PyLong_FromSsize_t(PyDict_GET_SIZE(nodes) - 1)) < 0 ||
            PyList_Append(self->source, group_source) < 0 || PyList_Append(self->depth, depth_value) < 0) {
            goto done;
        }
    }
    result = new_node(self->node_type, self->node_ref, self->ref, self->node_handle, Py_NewRef(handle));
done:
    Py_DECREF(key);
    Py_DECREF(depth_value);
    Py_XDECREF(group);
    Py_XDECREF(nodes);
    Py_XDECREF(group_source);
    Py_XDECREF(fresh);
    Py_XDECREF(handle);
    return result;
}

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchfold.engine._record.Recorder",
    .tp_doc = "Recorder(tape, groups, node_type, group_type): a fold's tape and groups, as Fold.add in C "
              "records into them.",
    .tp_basicsize = sizeof(Recorder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Recorder_init,
    .tp_dealloc = (destructor)Recorder_dealloc,
    .tp_traverse = (traverseproc)Recorder_traverse,
    .tp_clear = (inquiry)Recorder_clear,
};

/* ----------------------------------------------------------------------------------------- */

/* What FastAdd and FastSplit share: the Python function they wrap and their vectorcall. */
#define WRAPPER_HEAD   \
    PyObject_HEAD      \
    PyObject *function; \
    vectorcallfunc vectorcall;

typedef struct {
    WRAPPER_HEAD
} Wrapper;

typedef struct {
    WRAPPER_HEAD       /* function: the Python Fold.add */
    PyObject *recorder_name; /* "_recorder" */
} FastAdd;

/* FastAdd(fold, op, *args): the fold's recorder records it, or the Python add does. */
static PyObject *
FastAdd_vectorcall(FastAdd *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs >= 3 && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0)) {
        PyObject *recorder = PyObject_GetAttr(args[0], self->recorder_name);
        if (recorder == NULL) {
            PyErr_Clear(); /* a fold made without __init__: all in Python */
        }
        else {
            PyObject *node = NOT_HANDLED;
            if (Py_IS_TYPE(recorder, &RecorderType) && ((Recorder *)recorder)->ref != NULL) {
                node = record((Recorder *)recorder, args[1], args + 2, nargs - 2);
            }
            Py_DECREF(recorder);
            if (node != NOT_HANDLED) {
                return node;
            }
        }
    }
    return PyObject_Vectorcall(self->function, args, nargsf, kwnames);
}

/* 0 if the function a wrapper wraps is callable, else -1 with an error naming the call. */
static int
check_wrapped(const char *call, PyObject *function)
{
    if (!PyCallable_Check(function)) {
        PyErr_Format(PyExc_TypeError, "%s: function must be callable", call);
        return -1;
    }
    return 0;
}

static PyObject *
FastAdd_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *function;
    if (!PyArg_ParseTuple(args, "O:FastAdd", &function) || check_wrapped("FastAdd(function)", function) < 0) {
        return NULL;
    }
    FastAdd *self = (FastAdd *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->recorder_name = PyUnicode_InternFromString("_recorder");
    if (self->recorder_name == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->function = Py_NewRef(function);
    self->vectorcall = (vectorcallfunc)FastAdd_vectorcall;
    return (PyObject *)self;
}

static int
Wrapper_traverse(Wrapper *self, visitproc visit, void *arg)
{
    Py_VISIT(self->function);
    return 0;
}

static int
Wrapper_clear(Wrapper *self)
{
    Py_CLEAR(self->function);
    return 0;
}

static void
FastAdd_dealloc(FastAdd *self)
{
    PyObject_GC_UnTrack(self);
    Wrapper_clear((Wrapper *)self);
    Py_CLEAR(self->recorder_name);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* As a function: a bound method on an instance, itself on the class. */
static PyObject *
Wrapper_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, obj);
}

/* Its name, documentation and any attribute it lacks are the wrapped function's, which is its
 * __wrapped__ (what inspect.signature and help() read). */
static PyObject *
Wrapper_getattro(Wrapper *self, PyObject *name)
{
    if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__wrapped__") == 0) {
        return Py_NewRef(self->function);
    }
    static const char *forwarded[] = {"__doc__", "__module__", "__name__", "__qualname__", "__annotations__", NULL};
    for (int i = 0; PyUnicode_Check(name) && forwarded[i] != NULL; i++) {
        if (PyUnicode_CompareWithASCIIString(name, forwarded[i]) == 0) {
            return PyObject_GetAttr(self->function, name);
        }
    }
    PyObject *value = PyObject_GenericGetAttr((PyObject *)self, name);
    if (value == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        value = PyObject_GetAttr(self->function, name);
    }
    return value;
}

/* Pickled (and copied) as the function it wraps is: by its qualified name. */
static PyObject *
Wrapper_reduce(Wrapper *self, PyObject *Py_UNUSED(ignored))
{
    return PyObject_GetAttrString(self->function, "__qualname__");
}

static PyMethodDef Wrapper_methods[] = {
    {"__reduce__", (PyCFunction)Wrapper_reduce, METH_NOARGS, "Pickled by its qualified name, as a function is."},
    {NULL, NULL, 0, NULL},
};

/* <Fold.add in C, wrapping <function Fold.add at ...>> */
static PyObject *
Wrapper_repr(Wrapper *self)
{
    PyObject *name = PyObject_GetAttrString(self->function, "__qualname__");
    if (name == NULL) {
        return NULL;
    }
    PyObject *repr = PyUnicode_FromFormat("<%S in C, wrapping %R>", name, self->function);
    Py_DECREF(name);
    return repr;
}

#define WRAPPER_FLAGS \
    (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR)

static PyTypeObject FastAddType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchfold.engine._record.FastAdd",
    .tp_doc = "FastAdd(function): Fold.add, in C for its common calls and `function` for the others.",
    .tp_basicsize = sizeof(FastAdd),
    .tp_flags = WRAPPER_FLAGS,
    .tp_vectorcall_offset = offsetof(FastAdd, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = FastAdd_new,
    .tp_dealloc = (destructor)FastAdd_dealloc,
    .tp_traverse = (traverseproc)Wrapper_traverse,
    .tp_clear = (inquiry)Wrapper_clear,
    .tp_descr_get = Wrapper_get,
    .tp_getattro = (getattrofunc)Wrapper_getattro,
    .tp_repr = (reprfunc)Wrapper_repr,
    .tp_methods = Wrapper_methods,
};

/* ----------------------------------------------------------------------------------------- */

/* The most outputs FastSplit splits into itself; more go to the Python split. */
#define MAX_OUTPUTS 8

typedef struct {
    WRAPPER_HEAD /* function: the Python Node.split */
    PyTypeObject *node_type, *tape_type, *group_type;
    Py_ssize_t node_ref, node_handle;                                      /* Node's slots */
    Py_ssize_t tape_depth, tape_source, tape_index;                        /* Tape's lists of int */
    Py_ssize_t tape_outputs_of, tape_source_group, tape_source_output;     /* and the rest it reads */
    Py_ssize_t tape_ref;                                                   /* the ref its nodes hold */
    Py_ssize_t group_num_outputs, group_output_sources;                    /* Group's */
} FastSplit;

/* `SLOT(object, offset)` if it is an object of exactly `type` (borrowed), else NULL. */
static PyObject *
slot_of_type(PyObject *object, Py_ssize_t offset, PyTypeObject *type)
{
    PyObject *value = SLOT(object, offset);
    return value != NULL && Py_IS_TYPE(value, type) ? value : NULL;
}

/* node.split(num): a tuple of `num` new nodes, NULL with an error, or NOT_HANDLED. The same
 * handles and the same appends to the tape as the Python split, for a group whose number of
 * outputs is `num` already; its first split, a wrong `num` and every error are the Python one's. */
static PyObject *
split(FastSplit *self, PyObject *node, PyObject *num_value)
{
    if (!Py_IS_TYPE(node, self->node_type) || !PyLong_CheckExact(num_value)) {
        return NOT_HANDLED;
    }
    Py_ssize_t num = as_row(num_value);
    PyObject *ref = SLOT(node, self->node_ref);
    PyObject *tape = ref && PyWeakref_CheckRefExact(ref) ? referent(ref) : NULL; /* NULL: a fold that is gone */
    if (tape != NULL && (!Py_IS_TYPE(tape, self->tape_type) || SLOT(tape, self->tape_ref) != ref)) {
        Py_CLEAR(tape); /* not a tape's node, or one whose `_ref` is not its tape's own: Python */
    }
    PyObject *handle = slot_of_type(node, self->node_handle, &PyLong_Type);
    PyObject *outputs_of = tape ? slot_of_type(tape, self->tape_outputs_of, &PyDict_Type) : NULL;
    Py_ssize_t row = handle ? as_row(handle) : -1;
    if (num < 1 || num > MAX_OUTPUTS || outputs_of == NULL || row < 0) {
        Py_XDECREF(tape);
        return NOT_HANDLED;
    }
    /* Strong references first: the look-up in outputs_of may run Python code (the __eq__ of a
     * key that is not an int), which may change the node, the tape and its lists; everything
     * else is read after it. */
    Py_INCREF(ref);
    Py_INCREF(handle);
    Py_INCREF(outputs_of); /* (tape: a new reference already) */
    PyObject *result = NOT_HANDLED;
    PyObject *first_value = PyDict_GetItemWithError(outputs_of, handle);
    Py_ssize_t first = first_value ? as_row(first_value) : -1; /* >= 0: split before */
    if ((first_value != NULL && first < 0) || (first_value == NULL && PyErr_Occurred())) {
        PyErr_Clear();
        goto finish;
    }
    /* No Python code runs from here to the PyDict_SetItem below, which comes last. */
    PyObject *depths = slot_of_type(tape, self->tape_depth, &PyList_Type);
    PyObject *sources = slot_of_type(tape, self->tape_source, &PyList_Type);
    PyObject *indexes = slot_of_type(tape, self->tape_index, &PyList_Type);
    PyObject *source_group = slot_of_type(tape, self->tape_source_group, &PyList_Type);
    PyObject *source_output = slot_of_type(tape, self->tape_source_output, &PyList_Type);
    if (depths == NULL || sources == NULL || indexes == NULL || source_group == NULL || source_output == NULL ||
        row >= PyList_GET_SIZE(sources) || row >= PyList_GET_SIZE(depths) || row >= PyList_GET_SIZE(indexes)) {
        goto finish;
    }
    PyObject *source_value = PyList_GET_ITEM(sources, row);
    Py_ssize_t source = PyLong_CheckExact(source_value) ? PyLong_AsSsize_t(source_value) : -1;
    if (source == -1 && (!PyLong_CheckExact(source_value) || PyErr_Occurred())) {
        PyErr_Clear();
        goto finish;
    }
    int batch = source >= 0;
    Py_ssize_t owner = batch ? source : ~source;
    if (owner >= PyList_GET_SIZE(source_group) || owner >= PyList_GET_SIZE(source_output)) {
        goto finish;
    }
    PyObject *group = PyList_GET_ITEM(source_group, owner);
    PyObject *num_outputs = Py_IS_TYPE(group, self->group_type)
                                ? slot_of_type(group, self->group_num_outputs, &PyLong_Type)
                                : NULL;
    if (num_outputs == NULL || as_row(num_outputs) != num) {
        goto finish; /* the group's first split, or a wrong num: the Python split */
    }
    if (first >= 0) { /* split before: the same handles again, if they are rows of the tape */
        if (first > PyList_GET_SIZE(sources) - num) {
            goto finish;
        }
    }
    else {
        if (PyList_GET_ITEM(source_output, owner) != Py_None) {
            goto finish; /* an output of a split itself: the Python split's error */
        }
        PyObject *output_sources = SLOT(group, self->group_output_sources);
        if (output_sources == NULL || !PyRange_Check(output_sources) || PyObject_Length(output_sources) != num) {
            PyErr_Clear();
            goto finish;
        }
        /* Everything that can fail first; then the same appends as the Python split. */
        PyObject *outputs[MAX_OUTPUTS] = {NULL};
        PyObject *depth = Py_NewRef(PyList_GET_ITEM(depths, row));
        PyObject *index = Py_NewRef(PyList_GET_ITEM(indexes, row));
        first = PyList_GET_SIZE(sources);
        PyObject *first_new = PyLong_FromSsize_t(first);
        int failed = first_new == NULL;
        for (Py_ssize_t k = 0; k < num && !failed; k++) {
            PyObject *output = PySequence_GetItem(output_sources, k);
            outputs[k] = output == NULL || batch ? output : PyNumber_Invert(output);
            if (!batch) {
                Py_XDECREF(output);
            }
            failed = outputs[k] == NULL;
        }
        for (Py_ssize_t k = 0; k < num && !failed; k++) {
            failed = PyList_Append(depths, depth) < 0 || PyList_Append(indexes, index) < 0 ||
                     PyList_Append(sources, outputs[k]) < 0;
        }
        /* last, as it may run Python code (a colliding key's __eq__): nothing borrowed is read after it */
        if (!failed) {
            failed = PyDict_SetItem(outputs_of, handle, first_new) < 0;
        }
        for (Py_ssize_t k = 0; k < num; k++) {
            Py_XDECREF(outputs[k]);
        }
        Py_DECREF(depth);
        Py_DECREF(index);
        Py_XDECREF(first_new);
        if (failed) {
            result = NULL;
            goto finish;
        }
    }
    /* The nodes last: making them may run the garbage collector, and with it Python code. */
    result = PyTuple_New(num);
    for (Py_ssize_t k = 0; k < num && result != NULL; k++) {
        PyObject *output_handle = PyLong_FromSsize_t(first + k);
        PyObject *output = output_handle
                               ? new_node(self->node_type, self->node_ref, ref, self->node_handle, output_handle)
                               : NULL;
        if (output == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyTuple_SET_ITEM(result, k, output);
    }
finish:
    Py_DECREF(ref);
    Py_DECREF(tape);
    Py_DECREF(handle);
    Py_DECREF(outputs_of);
    return result;
}

/* FastSplit(node, num): split here, or by the Python split. */
static PyObject *
FastSplit_vectorcall(FastSplit *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) == 2 && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0)) {
        PyObject *nodes = split(self, args[0], args[1]);
        if (nodes != NOT_HANDLED) {
            return nodes;
        }
    }
    return PyObject_Vectorcall(self->function, args, nargsf, kwnames);
}

static PyObject *
FastSplit_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *keywords[] = {"function", "node_type", "tape_type", "group_type", NULL};
    PyObject *function;
    PyTypeObject *node_type, *tape_type, *group_type;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!O!:FastSplit", keywords, &function, &PyType_Type, &node_type,
                                     &PyType_Type, &tape_type, &PyType_Type, &group_type)) {
        return NULL;
    }
    if (check_wrapped("FastSplit(function, ...)", function) < 0 || check_node_type("FastSplit", node_type) < 0) {
        return NULL;
    }
    FastSplit *self = (FastSplit *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->function = Py_NewRef(function);
    self->vectorcall = (vectorcallfunc)FastSplit_vectorcall;
    self->node_type = (PyTypeObject *)Py_NewRef((PyObject *)node_type);
    self->tape_type = (PyTypeObject *)Py_NewRef((PyObject *)tape_type);
    self->group_type = (PyTypeObject *)Py_NewRef((PyObject *)group_type);
    if ((self->node_ref = slot_offset(node_type, "_ref")) < 0 ||
        (self->node_handle = slot_offset(node_type, "_handle")) < 0 ||
        (self->tape_depth = slot_offset(tape_type, "depth")) < 0 ||
        (self->tape_source = slot_offset(tape_type, "source")) < 0 ||
        (self->tape_index = slot_offset(tape_type, "index")) < 0 ||
        (self->tape_outputs_of = slot_offset(tape_type, "outputs_of")) < 0 ||
        (self->tape_source_group = slot_offset(tape_type, "source_group")) < 0 ||
        (self->tape_source_output = slot_offset(tape_type, "source_output")) < 0 ||
        (self->tape_ref = slot_offset(tape_type, "ref")) < 0 ||
        (self->group_num_outputs = slot_offset(group_type, "num_outputs")) < 0 ||
        (self->group_output_sources = slot_offset(group_type, "output_sources")) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
FastSplit_traverse(FastSplit *self, visitproc visit, void *arg)
{
    Py_VISIT(self->node_type);
    Py_VISIT(self->tape_type);
    Py_VISIT(self->group_type);
    return Wrapper_traverse((Wrapper *)self, visit, arg);
}

static int
FastSplit_clear(FastSplit *self)
{
    Py_CLEAR(self->node_type);
    Py_CLEAR(self->tape_type);
    Py_CLEAR(self->group_type);
    return Wrapper_clear((Wrapper *)self);
}

static void
FastSplit_dealloc(FastSplit *self)
{
    PyObject_GC_UnTrack(self);
    FastSplit_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject FastSplitType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchfold.engine._record.FastSplit",
    .tp_doc = "FastSplit(function, node_type, tape_type, group_type): Node.split, in C for a group whose "
              "outputs are known and `function` for the rest.",
    .tp_basicsize = sizeof(FastSplit),
    .tp_flags = WRAPPER_FLAGS,
    .tp_vectorcall_offset = offsetof(FastSplit, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = FastSplit_new,
    .tp_dealloc = (destructor)FastSplit_dealloc,
    .tp_traverse = (traverseproc)FastSplit_traverse,
    .tp_clear = (inquiry)FastSplit_clear,
    .tp_descr_get = Wrapper_get,
    .tp_getattro = (getattrofunc)Wrapper_getattro,
    .tp_repr = (reprfunc)Wrapper_repr,
    .tp_methods = Wrapper_methods,
};

/* ----------------------------------------------------------------------------------------- */

/* A column's (argument position's) sources, first-use order, and whether it is a whole result. */
typedef struct {
    Py_ssize_t first_key, num_keys; /* its distinct sources: keys[first_key:first_key + num_keys] */
    Py_ssize_t cluster;             /* the gather it joins; -1: a whole earlier result */
} Column;

/* plain_group(nodes, arity, tape_source, tape_index, source_calls, scratch): a group's gathers,
 * for a group whose every argument is a batched node's handle (see torchfold.engine.planner).
 *
 * Returns (wholes, gathers): wholes a list of (position, source) for positions that take an
 * earlier result whole and in order, gathers a list of (pieces, piece_calls, index, positions),
 * index being bytes of int64 (each item's call in the concatenation of the pieces, position
 * after position) or None when that is the items' order. Positions that read a common source
 * share a gather: a position joins the first gather, in order, that reads any of its sources.
 * None when a handle is a nobatch one, or anything is not as expected: the Python planner then
 * plans the group (and words any error).
 *
 * `scratch` (a bytearray of SCRATCH_PER_SOURCE * sizeof(Py_ssize_t) bytes per source, every
 * byte 0xff) holds marks per source: it is left as it was given (the sources marked are reset),
 * so that a call costs time in its items, not in the fold's sources. A scratch that is not all
 * 0xff gives a wrong result: the caller makes it once and passes only it. */
#define SCRATCH_PER_SOURCE 3

static PyObject *
plain_group(PyObject *module, PyObject *args)
{
    PyObject *nodes, *tape_source, *tape_index, *source_calls;
    Py_ssize_t arity;
    Py_buffer scratch;
    if (!PyArg_ParseTuple(args, "O!nO!O!O!w*:plain_group", &PyDict_Type, &nodes, &arity, &PyList_Type, &tape_source,
                          &PyList_Type, &tape_index, &PyList_Type, &source_calls, &scratch)) {
        return NULL;
    }
    Py_ssize_t count = PyDict_GET_SIZE(nodes), num_sources = PyList_GET_SIZE(source_calls);
    Py_ssize_t handles = PyList_GET_SIZE(tape_source);
    if (count < 1 || arity < 1 || arity > 64 || PyList_GET_SIZE(tape_index) != handles ||
        scratch.len < (Py_ssize_t)sizeof(Py_ssize_t) * SCRATCH_PER_SOURCE * num_sources) {
        PyBuffer_Release(&scratch);
        Py_RETURN_NONE;
    }
    /* per source (all -1 between calls): the column or piece that marked it, the first cluster
     * reading it, its calls */
    Py_ssize_t *mark = scratch.buf, *owner = mark + num_sources, *calls_of = owner + num_sources;
    PyObject *result = NULL, *wholes = NULL, *gathers = NULL;
    Py_ssize_t items = count * arity, touched = 0;
    /* per item, column after column: its source and its call; the sources marked; ... */
    Py_ssize_t *source = PyMem_Malloc(sizeof(Py_ssize_t) * items);
    Py_ssize_t *call = PyMem_Malloc(sizeof(Py_ssize_t) * items);
    Py_ssize_t *marked = PyMem_Malloc(sizeof(Py_ssize_t) * items);
    Py_ssize_t *keys = PyMem_Malloc(sizeof(Py_ssize_t) * items);         /* each column's distinct sources */
    Py_ssize_t *piece_source = PyMem_Malloc(sizeof(Py_ssize_t) * items); /* a gather's pieces */
    Py_ssize_t *piece_start = PyMem_Malloc(sizeof(Py_ssize_t) * items);  /* and where each starts */
    Column *columns = PyMem_Malloc(sizeof(Column) * arity);
    int64_t *index = PyMem_Malloc(sizeof(int64_t) * items);
    if (!source || !call || !marked || !keys || !piece_source || !piece_start || !columns || !index) {
        PyErr_NoMemory();
        goto done;
    }
    /* the handles' sources and calls (the tape's lists hold ints: no Python code runs here, and
     * nothing is read from the lists after the first object is made below, which may run the
     * garbage collector and with it Python code) */
    PyObject *key;
    Py_ssize_t position = 0, item = 0;
    while (PyDict_Next(nodes, &position, &key, NULL)) {
        if (!PyTuple_CheckExact(key) || PyTuple_GET_SIZE(key) != arity || item >= count) {
            goto not_plain;
        }
        for (Py_ssize_t p = 0; p < arity; p++) {
            Py_ssize_t row = as_index(PyTuple_GET_ITEM(key, p), handles);
            Py_ssize_t s = row < 0 ? -1 : as_index(PyList_GET_ITEM(tape_source, row), num_sources);
            Py_ssize_t c = s < 0 ? -1 : as_row(PyList_GET_ITEM(tape_index, row));
            if (c < 0) {
                goto not_plain; /* a nobatch handle (source < 0) */
            }
            if (calls_of[s] < 0) {
                marked[touched++] = s;
                calls_of[s] = as_row(PyList_GET_ITEM(source_calls, s));
            }
            if (calls_of[s] <= c) {
                goto not_plain; /* not a call of its source */
            }
            source[p * count + item] = s;
            call[p * count + item] = c;
        }
        item++;
    }
    if (item != count) {
        goto not_plain;
    }
    /* each column's distinct sources in first-use order; whole results; clusters */
    Py_ssize_t num_keys = 0, clusters = 0;
    for (Py_ssize_t p = 0; p < arity; p++) {
        Column *column = &columns[p];
        column->first_key = num_keys;
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t s = source[p * count + i];
            if (mark[s] != p) {
                mark[s] = p;
                keys[num_keys++] = s;
            }
        }
        column->num_keys = num_keys - column->first_key;
        int whole = column->num_keys == 1 && calls_of[keys[column->first_key]] == count;
        for (Py_ssize_t i = 0; whole && i < count; i++) {
            whole = call[p * count + i] == i;
        }
        if (whole) {
            column->cluster = -1;
            continue;
        }
        Py_ssize_t home = clusters; /* the first cluster that reads any of its sources, or a new one */
        for (Py_ssize_t k = column->first_key; k < num_keys; k++) {
            Py_ssize_t found = owner[keys[k]];
            if (found >= 0 && found < home) {
                home = found;
            }
        }
        if (home == clusters) {
            clusters++;
        }
        column->cluster = home;
        for (Py_ssize_t k = column->first_key; k < num_keys; k++) {
            if (owner[keys[k]] < 0 || owner[keys[k]] > home) {
                owner[keys[k]] = home;
            }
        }
    }
    for (Py_ssize_t t = 0; t < touched; t++) {
        mark[marked[t]] = -1; /* from here: a source's piece number in the gather being made */
    }
    /* each gather's index, in C; then the Python objects */
    Py_ssize_t gather_pieces[64], gather_end[64];
    int gather_in_order[64];
    Py_ssize_t size = 0, pieces_before = 0;
    for (Py_ssize_t cluster = 0; cluster < clusters; cluster++) {
        /* its pieces: its columns' sources in first-use order, column after column */
        Py_ssize_t pieces = 0, total = 0, start = size;
        for (Py_ssize_t p = 0; p < arity; p++) {
            Column *column = &columns[p];
            for (Py_ssize_t k = column->first_key; column->cluster == cluster && k < column->first_key + column->num_keys;
                 k++) {
                Py_ssize_t s = keys[k];
                if (mark[s] < 0) {
                    if (calls_of[s] > PY_SSIZE_T_MAX - total) {
                        goto not_plain; /* calls beyond a C integer: the Python planner refuses them */
                    }
                    mark[s] = pieces;
                    piece_source[pieces_before + pieces] = s;
                    piece_start[pieces_before + pieces] = total;
                    total += calls_of[s];
                    pieces++;
                }
            }
        }
        int in_order = 1;
        for (Py_ssize_t p = 0; p < arity; p++) {
            for (Py_ssize_t i = 0; columns[p].cluster == cluster && i < count; i++, size++) {
                index[size] = piece_start[pieces_before + mark[source[p * count + i]]] + call[p * count + i];
                in_order = in_order && index[size] == size - start;
            }
        }
        for (Py_ssize_t k = 0; k < pieces; k++) {
            mark[piece_source[pieces_before + k]] = -1;
        }
        gather_pieces[cluster] = pieces;
        gather_end[cluster] = size;
        gather_in_order[cluster] = in_order && size - start == total;
        pieces_before += pieces;
    }
    wholes = PyList_New(0);
    gathers = PyList_New(0);
    if (wholes == NULL || gathers == NULL) {
        goto done;
    }
    for (Py_ssize_t p = 0; p < arity; p++) {
        if (columns[p].cluster < 0 && append_new(wholes, Py_BuildValue("(nn)", p, keys[columns[p].first_key])) < 0) {
            goto done;
        }
    }
    for (Py_ssize_t cluster = 0, first_piece = 0; cluster < clusters; cluster++) {
        Py_ssize_t pieces = gather_pieces[cluster], start = cluster ? gather_end[cluster - 1] : 0;
        PyObject *piece_list = PyList_New(pieces), *call_list = PyList_New(pieces), *positions = PyList_New(0);
        PyObject *index_bytes =
            gather_in_order[cluster]
                ? Py_NewRef(Py_None)
                : PyBytes_FromStringAndSize((const char *)(index + start), sizeof(int64_t) * (gather_end[cluster] - start));
        int failed = !piece_list || !call_list || !positions || !index_bytes;
        for (Py_ssize_t k = 0; !failed && k < pieces; k++) {
            Py_ssize_t s = piece_source[first_piece + k];
            PyObject *number = PyLong_FromSsize_t(s), *calls = PyLong_FromSsize_t(calls_of[s]);
            if (number) {
                PyList_SET_ITEM(piece_list, k, number);
            }
            if (calls) {
                PyList_SET_ITEM(call_list, k, calls);
            }
            failed = !number || !calls;
        }
        for (Py_ssize_t p = 0; !failed && p < arity; p++) {
            failed = columns[p].cluster == cluster && append_new(positions, PyLong_FromSsize_t(p)) < 0;
        }
        PyObject *gather = failed ? NULL : PyTuple_Pack(4, piece_list, call_list, index_bytes, positions);
        Py_XDECREF(piece_list);
        Py_XDECREF(call_list);
        Py_XDECREF(positions);
        Py_XDECREF(index_bytes);
        if (append_new(gathers, gather) < 0) {
            goto done;
        }
        first_piece += pieces;
    }
    result = PyTuple_Pack(2, wholes, gathers);
    goto done;
not_plain:
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t t = 0; t < touched; t++) { /* the scratch as it was given */
        mark[marked[t]] = owner[marked[t]] = calls_of[marked[t]] = -1;
    }
    PyBuffer_Release(&scratch);
    Py_XDECREF(wholes);
    Py_XDECREF(gathers);
    PyMem_Free(source);
    PyMem_Free(call);
    PyMem_Free(marked);
    PyMem_Free(keys);
    PyMem_Free(piece_source);
    PyMem_Free(piece_start);
    PyMem_Free(columns);
    PyMem_Free(index);
    return result;
}

static PyMethodDef module_methods[] = {
    {"plain_group", plain_group, METH_VARARGS,
     "plain_group(nodes, arity, tape_source, tape_index, source_calls, scratch): (wholes, gathers) of a group whose "
     "every argument is a batched node, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "torchfold.engine._record",
    .m_doc = "Fold.add's and Node.split's common calls in C (optional: without it torchfold records in Python).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__record(void)
{
    if (PyType_Ready(&RecorderType) < 0 || PyType_Ready(&FastAddType) < 0 || PyType_Ready(&FastSplitType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Recorder", (PyObject *)&RecorderType) < 0 ||
        PyModule_AddObjectRef(m, "FastAdd", (PyObject *)&FastAddType) < 0 ||
        PyModule_AddObjectRef(m, "FastSplit", (PyObject *)&FastSplitType) < 0 ||
        PyModule_AddIntConstant(m, "SCRATCH_BYTES_PER_SOURCE", SCRATCH_PER_SOURCE * sizeof(Py_ssize_t)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
