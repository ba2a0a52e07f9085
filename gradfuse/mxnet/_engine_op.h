// One collective of gradfuse.mxnet as an asynchronous operation in MXNet's engine.
//
// MXNet's C API is reached only through the function pointers of gf_api, which the
// Python side fills from ctypes (gradfuse/mxnet/fence.py): nothing here links or
// includes MXNet. The engine calls gf_start on one of its worker threads once every
// read and write dependency of the operation is free. gf_start reads the data pointers
// (MXNet allocates lazily, so they exist only now), saves the engine's completion
// callback and marks the operation ready; it never waits, except under NaiveEngine,
// which needs every operation complete before its push returns. gradfuse's
// communication thread waits for "ready" (gf_wait_ready), runs the collective, and
// calls gf_complete, which hands MXNet the completion, with an error if there was one
// (MXNet rethrows it at wait_to_read()/asnumpy() of a dependent array, as Horovod's).
#ifndef GRADFUSE_ENGINE_OP_H
#define GRADFUSE_ENGINE_OP_H

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

namespace dmlc {
// dmlc-core's error type, as dmlc/logging.h defines it (a runtime_error and nothing
// else). MXNet copies the error it is handed (std::make_exception_ptr(*error)), so only
// this layout crosses the boundary.
struct Error : public std::runtime_error {
  explicit Error(const std::string &s) : std::runtime_error(s) {}
};
}  // namespace dmlc

extern "C" {
typedef int (*gf_get_data_t)(void *, void **);
typedef int (*gf_get_int_t)(void *, int *);
typedef int (*gf_get_ctx_t)(void *, int *, int *);
typedef int (*gf_get_shape_t)(void *, int *, const int **);
typedef const char *(*gf_last_error_t)();
typedef int (*gf_push_t)(void (*)(void *, void *, void *), void *, void (*)(void *), void *,
                         void *const *, int, void *const *, int, void *, int, const char *, bool);
typedef bool (*gf_chunk_query_t)(void *);
typedef void (*gf_chunk_reorder_t)(void *);
}

struct gf_api_t {
  gf_get_data_t get_data = nullptr;        // MXNDArrayGetData
  gf_get_int_t get_dtype = nullptr;        // MXNDArrayGetDType
  gf_get_int_t get_stype = nullptr;        // MXNDArrayGetStorageType
  gf_get_ctx_t get_context = nullptr;      // MXNDArrayGetContext
  gf_get_shape_t get_shape = nullptr;      // MXNDArrayGetShapeEx
  gf_last_error_t last_error = nullptr;    // MXGetLastError
  gf_push_t push = nullptr;                // MXEnginePushAsyncND
  // oneDNN builds: NDArray::Chunk::IsMKLDNN() const and NDArray::Chunk::Reorder2Default(),
  // called on the chunk (an NDArray's first member is its shared_ptr<Chunk>). With write
  // access the operation converts an array in a oneDNN layout back to row-major in place,
  // which is what MXNet's own Reorder2DefaultAsync does inside its engine operation;
  // MXNDArrayGetData would instead push that operation and wait for it: a deadlock here.
  gf_chunk_query_t chunk_is_onednn = nullptr;
  gf_chunk_reorder_t chunk_reorder = nullptr;
  // The start callback may compute a data pointer as the storage's address (the first word
  // of NDArray::Chunk, its Storage::Handle's dptr) plus the array's offset in it, learned
  // from MXNDArrayGetData at an earlier call (gf_op::memo). Set by the Python side once it
  // has checked that layout on this MXNet (fence.py); cleared here if a call ever disagrees.
  std::atomic<bool> direct{false};
};

static gf_api_t gf_api;

struct gf_on_complete {     // mxnet::engine::CallbackOnComplete
  void (*fn)(void *, void *, const dmlc::Error *);
  void *engine;
  void *param;
};

enum { GF_PUSHED = 0, GF_READY = 1, GF_DONE = 2 };

struct gf_op {
  std::atomic<int> refs{2};       // the Python object and the engine
  int n = 0;                      // arrays: [0, n_read) read, [n_read, n) written
  int n_read = 0;
  std::vector<void *> handles;    // NDArrayHandles (the NDArrays are kept alive by the Python object)
  std::vector<void *> deps;       // the engine's dependencies: [0, n_dep_read) read, the rest written
  int n_dep_read = 0;
  int64_t *ptrs = nullptr;        // written by gf_start
  int64_t *memo = nullptr;        // or [2n]: per array the storage it was seen in, then its offset there
  bool naive = false;             // NaiveEngine: complete before the push returns
  bool reorder_only = false;      // the layout pass before an out-of-place collective
  std::mutex mu;
  std::condition_variable cv;
  int state = GF_PUSHED;
  gf_on_complete cb{nullptr, nullptr, nullptr};
  std::string error;              // a pointer that could not be read; under NaiveEngine, the result
};

// An NDArray's storage (its first member is the shared_ptr<Chunk> that holds the engine
// variable): arrays that share it (the same array twice, views, reshapes) share one
// variable, and MXNet's engine, given one variable twice, waits for itself.
static inline void *gf_chunk_ptr(void *handle) { return *static_cast<void *const *>(handle); }

static inline void *gf_chunk_of(void *handle) {
  void *chunk = gf_chunk_ptr(handle);
  return chunk != nullptr ? chunk : handle;
}

// The dependencies of op: each storage once, written if any of its arrays is written.
// Usually every array has a storage of its own: one pass over a flat open-addressing table
// of the storages shows it (2000 arrays: ~15 us, where a hash set's node per array took
// ~250 us of a call), and the dependencies are the handles as they are. Shared storage
// takes the slower path that merges them.
static bool gf_storages_distinct(const gf_op *op) {
  size_t cap = 16;
  int bits = 4;
  while (cap < 2 * op->handles.size()) cap <<= 1, ++bits;
  std::vector<void *> table(cap, nullptr);
  for (void *h : op->handles) {
    void *c = gf_chunk_of(h);             // never null
    size_t k = static_cast<size_t>((reinterpret_cast<uintptr_t>(c) * 0x9E3779B97F4A7C15ull) >> (64 - bits));
    while (table[k] != nullptr) {
      if (table[k] == c) return false;
      k = (k + 1) & (cap - 1);
    }
    table[k] = c;
  }
  return true;
}

static void gf_set_deps(gf_op *op) {
  if (gf_storages_distinct(op)) {
    op->deps.assign(op->handles.begin(), op->handles.end());     // [0, n_read) read, the rest written
    op->n_dep_read = op->n_read;
    return;
  }
  std::unordered_set<void *> seen;
  seen.reserve(2 * static_cast<size_t>(op->n) + 1);
  std::vector<void *> reads;
  op->deps.clear();
  for (int i = op->n_read; i < op->n; ++i)
    if (seen.insert(gf_chunk_of(op->handles[i])).second) op->deps.push_back(op->handles[i]);
  for (int i = 0; i < op->n_read; ++i)
    if (seen.insert(gf_chunk_of(op->handles[i])).second) reads.push_back(op->handles[i]);
  op->n_dep_read = static_cast<int>(reads.size());
  op->deps.insert(op->deps.begin(), reads.begin(), reads.end());
}

static inline void gf_set_direct(bool on) { gf_api.direct.store(on); }
static inline bool gf_get_direct() { return gf_api.direct.load(); }

static inline void gf_release(gf_op *op) {
  if (op->refs.fetch_sub(1) == 1) delete op;
}

// MXNet lets go of the operation. If it never started it, MXNet skipped it: one of its
// arrays carries the error of an earlier operation (MXNet then completes the operation
// without running it, and rethrows that error at the next wait). The communication
// thread must not wait for a start that never comes: the operation is marked ready,
// with an error, and its collective is refused on every rank.
static void gf_engine_deleter(void *param) {
  gf_op *op = static_cast<gf_op *>(param);
  {
    std::lock_guard<std::mutex> lk(op->mu);
    if (op->state == GF_PUSHED) {
      op->error = "MXNet skipped the operation: one of its arrays carries the error of an earlier "
                  "operation (MXNet raises that error at the next wait on them)";
      op->state = GF_READY;
      op->cv.notify_all();
    }
  }
  gf_release(op);
}

static inline bool gf_is_onednn(void *handle) {
  if (gf_api.chunk_is_onednn == nullptr) return false;
  void *chunk = gf_chunk_ptr(handle);
  return chunk != nullptr && gf_api.chunk_is_onednn(chunk);
}

// On an engine worker (or, under NaiveEngine, the pushing thread): every dependency is free.
static void gf_start(void *rctx, void *on_complete, void *param) {
  (void)rctx;
  gf_op *op = static_cast<gf_op *>(param);
  gf_on_complete cb = *static_cast<gf_on_complete *>(on_complete);
  std::string err;
  if (op->reorder_only) {     // every array is a write dependency here
    for (int i = 0; i < op->n; ++i)
      if (gf_is_onednn(op->handles[i])) gf_api.chunk_reorder(gf_chunk_ptr(op->handles[i]));
    {
      std::lock_guard<std::mutex> lk(op->mu);
      op->state = GF_DONE;      // the Python side may let go of the arrays now
    }
    cb.fn(cb.engine, cb.param, nullptr);
    return;
  }
  bool checked = false;      // one array per call is read both ways: a disagreement turns `direct` off
  for (int i = 0; i < op->n; ++i) {
    void *h = op->handles[i];
    void *p = nullptr;
    if (gf_is_onednn(h)) {
      if (i >= op->n_read) {
        gf_api.chunk_reorder(gf_chunk_ptr(h));
      } else {            // (never MXNDArrayGetData: it would wait on the engine from inside it)
        if (err.empty()) err = "ValueError: input " + std::to_string(i) + " changed to a oneDNN layout after the call";
        op->ptrs[i] = 0;
        continue;
      }
    }
    // MXNDArrayGetData costs ~140 ns an array (2000 arrays: 0.28 ms a call); an array seen
    // before in the same storage is its storage's address plus the offset it had then
    void *chunk = gf_chunk_ptr(h);
    char *base = chunk != nullptr ? *static_cast<char *const *>(chunk) : nullptr;
    int64_t *memo = op->memo;
    // (relaxed atomics: two operations that only read the same arrays may start at once,
    // and both write the same words)
    if (memo != nullptr && base != nullptr &&
        __atomic_load_n(&memo[i], __ATOMIC_RELAXED) == reinterpret_cast<int64_t>(chunk) &&
        gf_api.direct.load(std::memory_order_relaxed)) {
      char *q = base + __atomic_load_n(&memo[op->n + i], __ATOMIC_RELAXED);
      if (checked) {
        op->ptrs[i] = reinterpret_cast<int64_t>(q);
        continue;
      }
      checked = true;
      void *r = nullptr;
      int rc = gf_api.get_data(h, &r);
      if (rc == 0 && r == static_cast<void *>(q)) {
        op->ptrs[i] = reinterpret_cast<int64_t>(q);
        continue;
      }
      if (rc == 0) {                         // not the layout fence.py checked: never again, and
        gf_api.direct.store(false);          // this call's pointers from the start, the slow way
        i = -1;
        continue;
      }
    }
    if (gf_api.get_data(h, &p) != 0 && err.empty()) err = gf_api.last_error();
    op->ptrs[i] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
    if (memo != nullptr && chunk != nullptr && p != nullptr) {
      base = *static_cast<char *const *>(chunk);      // (MXNDArrayGetData allocates a lazy array)
      if (base != nullptr) {
        __atomic_store_n(&memo[op->n + i], static_cast<int64_t>(static_cast<char *>(p) - base), __ATOMIC_RELAXED);
        __atomic_store_n(&memo[i], reinterpret_cast<int64_t>(chunk), __ATOMIC_RELAXED);
      }
    }
  }
  std::unique_lock<std::mutex> lk(op->mu);
  op->cb = cb;
  op->error = err;
  op->state = GF_READY;
  op->cv.notify_all();
  if (op->naive) {
    op->cv.wait(lk, [op] { return op->state == GF_DONE; });
    lk.unlock();
    cb.fn(cb.engine, cb.param, nullptr);      // NaiveEngine drops errors: Python raises them
  }
}

// The communication thread, without the GIL: wait until gf_start has run.
static void gf_wait_ready(gf_op *op) {
  std::unique_lock<std::mutex> lk(op->mu);
  op->cv.wait(lk, [op] { return op->state != GF_PUSHED; });
}

// The communication thread, without the GIL: the collective has finished (msg: its error).
static void gf_complete(gf_op *op, const char *msg) {
  std::unique_lock<std::mutex> lk(op->mu);
  if (op->state == GF_DONE) return;
  if (op->naive || op->cb.fn == nullptr) {     // NaiveEngine, or never started (a failed push)
    if (msg != nullptr) op->error = msg;
    op->state = GF_DONE;
    op->cv.notify_all();
    return;
  }
  op->state = GF_DONE;
  gf_on_complete cb = op->cb;
  lk.unlock();
  if (msg != nullptr) {
    dmlc::Error e(msg);
    cb.fn(cb.engine, cb.param, &e);
  } else {
    cb.fn(cb.engine, cb.param, nullptr);
  }
}

#endif  // GRADFUSE_ENGINE_OP_H
