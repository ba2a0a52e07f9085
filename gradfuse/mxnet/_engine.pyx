# distutils: language = c++
"""gradfuse.mxnet's C level: one pass over a call's NDArrays, and engine operations.

Framework-free in the build: MXNet's C API is called through function pointers that
``configure`` receives (``gradfuse/mxnet/fence.py`` takes them from ctypes), so this
extension neither links nor includes MXNet. The C++ half is ``_engine_op.h``.

* ``scan(nds, handles, nbytes, mxtypes, flags)``: every NDArray's handle, MXNet dtype,
  storage type, device and shape in one C loop (no DLPack export, no wait); returns the
  signature gradfuse's plan cache is keyed by (``gradfuse._core.scan``'s format).
* ``Op``: one push into MXNet's engine (``MXEnginePushAsyncND``) whose start callback is
  C (no GIL), reads the data pointers and marks the operation ready; ``wait_ready()`` and
  ``complete(error)`` are for gradfuse's communication thread.
"""
from libc.stdint cimport int64_t, uintptr_t
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport Py_TYPE
from cpython.ref cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdlib cimport malloc, free, realloc
from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.vector cimport vector

cdef extern from "_engine_op.h" nogil:
    ctypedef int (*gf_get_data_t)(void*, void**)
    ctypedef int (*gf_get_int_t)(void*, int*)
    ctypedef int (*gf_get_ctx_t)(void*, int*, int*)
    ctypedef int (*gf_get_shape_t)(void*, int*, const int**)
    ctypedef const char* (*gf_last_error_t)()
    ctypedef int (*gf_push_t)(void (*)(void*, void*, void*), void*, void (*)(void*), void*,
                              void* const*, int, void* const*, int, void*, int, const char*, cbool)
    ctypedef cbool (*gf_chunk_query_t)(void*)
    ctypedef void (*gf_chunk_reorder_t)(void*)
    struct gf_api_t:
        gf_get_data_t get_data
        gf_get_int_t get_dtype
        gf_get_int_t get_stype
        gf_get_ctx_t get_context
        gf_get_shape_t get_shape
        gf_last_error_t last_error
        gf_push_t push
        gf_chunk_query_t chunk_is_onednn
        gf_chunk_reorder_t chunk_reorder
    gf_api_t gf_api
    void gf_set_direct(cbool)
    cbool gf_get_direct()
    cppclass gf_op:
        int n
        int n_read
        vector[void*] handles
        vector[void*] deps
        int n_dep_read
        int64_t* ptrs
        int64_t* memo
        cbool naive
        cbool reorder_only
        int state
        string error
    void gf_set_deps(gf_op*)
    void gf_start(void*, void*, void*)
    void gf_engine_deleter(void*)
    void gf_release(gf_op*)
    void gf_wait_ready(gf_op*)
    void gf_complete(gf_op*, const char*)
    int GF_DONE

# scan flags, per array
BAD_DEVICE = 1        # not a CPU array
BAD_STORAGE = 2       # sparse (row_sparse, csr)
BAD_SHAPE = 4         # no known shape
NOT_REDUCIBLE = 8     # a dtype gradfuse does not reduce (uint8, int8, bool, ...)

# MXNet's dtype codes (mshadow) -> gradfuse's kernel codes (gradfuse.dtypes); 0: not reduced
cdef int _GF_CODE[16]
_GF_CODE[:] = [2, 3, 1, 0, 4, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0]
# MXNet's dtype codes -> bytes per element (0: unknown)
cdef int _ITEMSIZE[16]
_ITEMSIZE[:] = [4, 8, 2, 1, 4, 1, 8, 1, 2, 2, 4, 8, 2, 0, 0, 0]

cdef bint _configured = False


def configure(int64_t get_data, int64_t get_dtype, int64_t get_stype, int64_t get_context,
              int64_t get_shape, int64_t last_error, int64_t push, int64_t chunk_is_onednn=0,
              int64_t chunk_reorder=0):
    """Hand over the addresses of MXNet's C functions (and, on oneDNN builds, the two
    chunk methods; 0 where absent). Direct pointers (``set_direct``) start off."""
    global _configured
    gf_api.get_data = <gf_get_data_t> <uintptr_t> get_data
    gf_api.get_dtype = <gf_get_int_t> <uintptr_t> get_dtype
    gf_api.get_stype = <gf_get_int_t> <uintptr_t> get_stype
    gf_api.get_context = <gf_get_ctx_t> <uintptr_t> get_context
    gf_api.get_shape = <gf_get_shape_t> <uintptr_t> get_shape
    gf_api.last_error = <gf_last_error_t> <uintptr_t> last_error
    gf_api.push = <gf_push_t> <uintptr_t> push
    if chunk_is_onednn and chunk_reorder:
        gf_api.chunk_is_onednn = <gf_chunk_query_t> <uintptr_t> chunk_is_onednn
        gf_api.chunk_reorder = <gf_chunk_reorder_t> <uintptr_t> chunk_reorder
    else:
        gf_api.chunk_is_onednn = NULL
        gf_api.chunk_reorder = NULL
    gf_set_direct(False)
    _configured = True


def set_direct(bint on):
    """Let the start callback compute the data pointer of an array it has seen before in
    the same storage (the storage's address plus the array's offset, ``_engine_op.h``);
    only once the caller has checked MXNet's layout. Off again by itself if a call's check
    ever disagrees."""
    gf_set_direct(on)


def direct():
    """Whether direct pointers are on."""
    return gf_get_direct()


def same_objects(list a, tuple b):
    """Whether list ``a`` holds exactly the objects of tuple ``b``, in order (identity; one C
    loop: the scan cache's test, 2000 arrays in ~2 us)."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(a)
    if n != PyTuple_GET_SIZE(b):
        return False
    for i in range(n):
        if PyList_GET_ITEM(a, i) != PyTuple_GET_ITEM(b, i):
            return False
    return True


def all_of_type(list a, type t):
    """Whether every item of ``a`` is exactly of type ``t`` (not a subclass; one C loop)."""
    cdef Py_ssize_t i
    for i in range(PyList_GET_SIZE(a)):
        if <PyObject*> Py_TYPE(<object> PyList_GET_ITEM(a, i)) != <PyObject*> t:
            return False
    return True


cdef inline void* _handle_of(object nd) except? NULL:
    return <void*> <uintptr_t> (<object> nd.handle).value


def scan(list nds, int64_t[::1] handles, int64_t[::1] nbytes, int64_t[::1] mxtypes, int64_t[::1] flags):
    """Read every NDArray's handle, dtype, storage type, device and shape in one C loop.

    Fills the tables (``mxtypes``: MXNet's dtype codes; ``flags``: BAD_* and
    NOT_REDUCIBLE bits) and returns the signature as bytes: per array the int64 words
    ``[gradfuse dtype code, ndim, dim0, ...]`` (code 0 for dtypes gradfuse does not
    reduce). Raises RuntimeError (MXNet's message) if MXNet refuses a query.
    """
    cdef Py_ssize_t n = PyList_GET_SIZE(nds), i, d, cap, used = 0
    cdef int dtype, stype, dev_type, dev_id, ndim
    cdef const int* dims
    cdef int64_t f, count
    cdef void* h
    cdef int64_t* sig
    if not _configured:
        raise RuntimeError("gradfuse.mxnet._engine: configure() was not called")
    if handles.shape[0] < n or nbytes.shape[0] < n or mxtypes.shape[0] < n or flags.shape[0] < n:
        raise ValueError("scan: tables are shorter than the list of arrays")
    cap = 4 * n + 8
    sig = <int64_t*> malloc(cap * sizeof(int64_t))
    if sig == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            h = _handle_of(<object> PyList_GET_ITEM(nds, i))
            handles[i] = <int64_t> <uintptr_t> h
            f = 0
            if gf_api.get_dtype(h, &dtype) != 0 or gf_api.get_stype(h, &stype) != 0 \
                    or gf_api.get_context(h, &dev_type, &dev_id) != 0 or gf_api.get_shape(h, &ndim, &dims) != 0:
                raise RuntimeError(gf_api.last_error().decode("utf-8", "replace"))
            if dev_type != 1 and dev_type != 3 and dev_type != 5:        # cpu, cpu_pinned, cpu_shared
                f |= BAD_DEVICE
            if stype != 0:
                f |= BAD_STORAGE
            if dtype < 0 or dtype >= 16 or _ITEMSIZE[dtype] == 0:
                f |= NOT_REDUCIBLE
                dtype = 15
            elif _GF_CODE[dtype] == 0:
                f |= NOT_REDUCIBLE
            if ndim < 0:
                f |= BAD_SHAPE
                ndim = 0
            if used + 2 + ndim > cap:
                cap = 2 * cap + ndim + 2
                sig = <int64_t*> realloc(sig, cap * sizeof(int64_t))
                if sig == NULL:
                    raise MemoryError()
            sig[used] = _GF_CODE[dtype]
            sig[used + 1] = ndim
            used += 2
            count = 1
            for d in range(ndim):
                if dims[d] < 0:
                    f |= BAD_SHAPE
                sig[used] = dims[d]
                count *= dims[d]
                used += 1
            mxtypes[i] = dtype
            nbytes[i] = count * _ITEMSIZE[dtype] if not f & BAD_SHAPE else 0
            flags[i] = f
        return PyBytes_FromStringAndSize(<char*> sig, used * sizeof(int64_t))
    finally:
        free(sig)


cdef class Op:
    """One operation in MXNet's engine: ``handles[:n_read]`` read, the rest written.

    ``push(name)`` hands it to the engine and returns at once (under NaiveEngine only
    after ``complete``). The data pointers, written by the engine's start callback, are
    ``ptrs`` once ``wait_ready()`` has returned. The Python object keeps the NDArrays
    (``keep``) and the tables alive until the operation completes. ``memo`` (int64,
    two words per array, kept by the caller across calls with the same arrays): where
    the callback learns each array's storage and offset, for ``set_direct``.
    """
    cdef gf_op* op
    cdef readonly object ptrs, keep, memo
    cdef readonly bint pushed

    def __cinit__(self, int64_t[::1] handles, int n_read, int64_t[::1] ptrs, keep, bint naive,
                  bint reorder_only=False, int64_t[::1] memo=None):
        cdef Py_ssize_t i
        if handles.shape[0] > ptrs.shape[0] or n_read > handles.shape[0]:
            raise ValueError("Op: bad tables")
        if memo is not None and memo.shape[0] != 2 * handles.shape[0]:
            raise ValueError("Op: memo must hold two words per array")
        self.op = new gf_op()
        self.op.n = handles.shape[0]
        self.op.n_read = n_read
        self.op.handles.resize(handles.shape[0])
        for i in range(handles.shape[0]):
            self.op.handles[i] = <void*> <uintptr_t> handles[i]
        self.op.ptrs = &ptrs[0] if ptrs.shape[0] else NULL
        self.op.memo = &memo[0] if memo is not None and memo.shape[0] else NULL
        self.op.naive = naive
        self.op.reorder_only = reorder_only
        gf_set_deps(self.op)      # each storage once: MXNet's engine given a variable twice waits for itself
        self.ptrs, self.keep = ptrs.base, keep
        self.memo = memo.base if memo is not None else None
        self.pushed = False

    def __dealloc__(self):
        if self.op != NULL:
            if not self.pushed:
                gf_release(self.op)      # the engine never took its reference
            gf_release(self.op)

    def push(self, bytes name, int prop, int dev_type=1, int dev_id=0):
        """Push into MXNet's engine (``prop``: an ``mxnet::FnProperty`` value). Raises
        RuntimeError with MXNet's message if the push fails."""
        cdef int ctx[2]
        cdef int prop_ = prop
        cdef int ret
        cdef const char* cname = name
        cdef gf_op* op = self.op
        ctx[0] = dev_type
        ctx[1] = dev_id
        self.pushed = True
        with nogil:          # NaiveEngine runs the start callback here, and it waits for the collective
            ret = gf_api.push(gf_start, <void*> op, gf_engine_deleter, <void*> ctx,
                              op.deps.data(), op.n_dep_read, op.deps.data() + op.n_dep_read,
                              <int> op.deps.size() - op.n_dep_read, <void*> &prop_, 0, cname, False)
        if ret != 0:
            raise RuntimeError(gf_api.last_error().decode("utf-8", "replace"))

    def wait_ready(self):
        """Block (without the GIL) until the engine has started the operation; return the
        error of reading a data pointer, or None."""
        with nogil:
            gf_wait_ready(self.op)
        return self.op.error.decode("utf-8", "replace") if self.op.error.size() else None

    def complete(self, error=None):
        """Complete the engine operation; ``error`` (str) is what MXNet rethrows."""
        cdef bytes msg
        cdef const char* c = NULL
        if error is not None:
            msg = str(error).encode("utf-8", "replace")
            c = msg
        with nogil:
            gf_complete(self.op, c)
        self.keep = None

    @property
    def shared(self):
        """True when some arrays of the operation share their storage (one engine variable)."""
        return self.op.deps.size() < <size_t> self.op.n

    @property
    def done(self):
        return self.op.state == GF_DONE

    @property
    def ready(self):
        return self.op.state != 0
