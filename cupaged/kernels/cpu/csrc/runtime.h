// runtime.h: runs a CUDA kernel's thread blocks on the CPU (the other half of shim.h).
//
// Included once, by the translation unit the Python loader generates for a kernel file:
//
//     [shim.h, force-included]  [runtime.h]  [the kernel .cu]  [launch table + C entry points]
//
// Execution model (DESIGN.md §5):
//
//   launch ── workers (OS threads: the caller + pthreads) take blocks from a shared counter
//               └─ worker ── runs one block at a time: one fiber per CUDA thread, all on this OS
//                            thread, switched by hand (to_fiber/to_scheduler below, ns), never
//                            preemptively: a fiber runs until it blocks (barrier, warp collective)
//                            or returns.
//
// A scheduler loop on the worker's own stack sweeps the block's fibers in the launch's order
// (forward, reverse, warp_ahead) and resumes each runnable one; a fiber that has not run yet is
// started by a runner (see "Fibers"), which calls the kernel directly for it and for the new
// fibers after it while none blocks, so that a barrier-free block costs about one function call
// per thread rather than two switches. When a sweep finds nothing to run while fibers are still
// alive, the block is deadlocked: the launch fails with a description of who waits where. A
// failed assert, a divergent barrier or a malformed collective fails the launch the same way. The
// failing fiber's stack and every blocked fiber's stack are simply abandoned (handed out afresh
// in the next block), so a failure is never a hang or a crash.
//
// Nothing inside a block needs locks or atomics: its fibers share one OS thread. Only the block
// counter, the first-error slot and the stack pool are shared between workers.
#pragma once

namespace cupaged_cpu {

// ---- Context switch -------------------------------------------------------------------------
// to_fiber(&scheduler_sp, fiber_sp) and to_scheduler(&fiber_sp, scheduler_sp) each save the
// callee-saved registers of the System V x86-64 ABI (rbx, rbp, r12-r15) on the current stack,
// store the stack pointer in the first argument, load the second and restore the same registers
// from there. Everything else is caller-saved, so the C++ caller has already spilled what it
// needs.
//
// Two copies of one body, each ending in `pop; jmp` rather than `ret`, because of the CPU's branch
// predictors: a `ret` is predicted from the return-stack buffer, which always names the caller of
// this very switch, so every switch mispredicted (about 20 ns per round trip, scheduler -> fiber
// -> scheduler, against about 5 ns now). The jump of to_scheduler always lands at the scheduler's
// one call site, and the jump of to_fiber mostly at the same few places (fiber_entry, a barrier),
// which the indirect-branch predictor learns.
//
// The SSE control/status register and the x87 control word (also callee-saved) are not switched:
// the scheduler and every fiber run on one OS thread with its floating-point environment, which
// neither the runtime nor CUDA code changes (device code has no rounding-mode or flush control),
// so they are equal at every switch; saving and restoring them cost ~3 ns per switch.
//
// A new fiber's stack is laid out as if it had called to_scheduler itself: "returning" lands in
// fiber_entry with r12 = the function to run and r13 = its argument.
extern "C" void cupaged_cpu_to_fiber(void** from_sp, void* to_sp);
extern "C" void cupaged_cpu_to_scheduler(void** from_sp, void* to_sp);
extern "C" void cupaged_cpu_fiber_entry();
#define CUPAGED_CPU_SWITCH_BODY \
  "    pushq %rbp\n"            \
  "    pushq %rbx\n"            \
  "    pushq %r12\n"            \
  "    pushq %r13\n"            \
  "    pushq %r14\n"            \
  "    pushq %r15\n"            \
  "    movq %rsp, (%rdi)\n"     \
  "    movq %rsi, %rsp\n"       \
  "    popq %r15\n"             \
  "    popq %r14\n"             \
  "    popq %r13\n"             \
  "    popq %r12\n"             \
  "    popq %rbx\n"             \
  "    popq %rbp\n"             \
  "    popq %rax\n"             \
  "    jmpq *%rax\n"
asm(R"(
    .text
    .p2align 4
    .globl cupaged_cpu_to_fiber
    .hidden cupaged_cpu_to_fiber
    .type cupaged_cpu_to_fiber, @function
cupaged_cpu_to_fiber:
)" CUPAGED_CPU_SWITCH_BODY R"(
    .size cupaged_cpu_to_fiber, .-cupaged_cpu_to_fiber

    .p2align 4
    .globl cupaged_cpu_to_scheduler
    .hidden cupaged_cpu_to_scheduler
    .type cupaged_cpu_to_scheduler, @function
cupaged_cpu_to_scheduler:
)" CUPAGED_CPU_SWITCH_BODY R"(
    .size cupaged_cpu_to_scheduler, .-cupaged_cpu_to_scheduler

    .p2align 4
    .globl cupaged_cpu_fiber_entry
    .hidden cupaged_cpu_fiber_entry
    .type cupaged_cpu_fiber_entry, @function
cupaged_cpu_fiber_entry:
    movq %r13, %rdi
    callq *%r12
    ud2
    .size cupaged_cpu_fiber_entry, .-cupaged_cpu_fiber_entry
)");
#undef CUPAGED_CPU_SWITCH_BODY

// Size of one fiber stack and of the inaccessible guard page below it. A guard-page hit (deep
// recursion, a huge local array) is a SIGSEGV: kernels should keep per-thread arrays small.
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kStackBytes = 512 * 1024;  // ASan's redzones make frames several times larger
#else
constexpr size_t kStackBytes = 128 * 1024;
#endif
constexpr size_t kGuardBytes = 4096;
constexpr unsigned kMaxThreadsPerBlock = 1024;

// ---- Launch table (filled by the generated code) ----------------------------------------------
// One entry per name expression: the kernel, type-erased, and a thunk that knows its parameter
// types. Parameter kinds, for the Python-side argument check: 'p' pointer, 'f' floating point,
// 'i' signed integer, 'u' unsigned integer, 'b' bool, 'o' anything else (struct, __half).
struct KernelEntry {
  const char* name;
  void (*function)();
  void (*thunk)(void (*function)(), void** args);
  int num_params;
  const size_t* param_sizes;
  const char* param_kinds;
};

template <typename T>
constexpr char param_kind() {
  return std::is_pointer<T>::value                                   ? 'p'
         : std::is_same<T, bool>::value                              ? 'b'
         : std::is_floating_point<T>::value                          ? 'f'
         : std::is_integral<T>::value && std::is_signed<T>::value    ? 'i'
         : std::is_integral<T>::value                                ? 'u'
                                                                     : 'o';
}

// args[i] points at the value of parameter i (a pointer value for array arguments).
template <typename... P, size_t... I>
void invoke(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
  (void)args;
  kernel(*static_cast<P*>(args[I])...);
}

template <typename... P>
void thunk(void (*function)(), void** args) {
  invoke(reinterpret_cast<void (*)(P...)>(function), args, std::index_sequence_for<P...>{});
}

template <typename... P>
KernelEntry make_entry(const char* name, void (*kernel)(P...)) {
  static const size_t sizes[] = {sizeof(P)..., 0};
  static const char kinds[] = {param_kind<P>()..., '\0'};
  return KernelEntry{name, reinterpret_cast<void (*)()>(kernel), &thunk<P...>,
                     static_cast<int>(sizeof...(P)), sizes, kinds};
}

// ---- Launch and worker state ------------------------------------------------------------------
enum Schedule : int { kForward = 0, kReverse = 1, kWarpAhead = 2 };
enum FiberState : unsigned char { kRunnable, kBlocked, kExited };

struct Launch {
  const KernelEntry* kernel;
  void** args;
  dim3 grid, block;
  size_t shared_bytes;
  unsigned long long num_blocks;
  unsigned threads_per_block;
  Schedule schedule;
  bool strict;
  unsigned long long next_block;  // shared between workers (atomic)
  int failed;                     // shared between workers (atomic): 0, then 1 once
  char* error;
  size_t error_len;
  int pool_helpers;  // pool threads inside this launch (under the pool's mutex)
};

// The asynchronous copies a CUDA thread has issued and not yet seen land (shim.h section 11).
struct AsyncCopy {
  unsigned char data[16];  // the source bytes, read at issue, then the zero fill
  unsigned char* dst;
  const char* file;
  int line;
  unsigned batch;  // the thread's commits before this copy
  unsigned bytes;
};

struct Pipeline {
  unsigned count, capacity;  // pending copies, in issue order (so in batch order)
  unsigned commits;          // batches committed by the thread in this block
  AsyncCopy* copies;
};

struct Fiber {
  void* sp;         // saved stack pointer while suspended; null until the first resume
  char* stack_top;  // the stack it took at its first resume (see "Stacks")
  unsigned stack;   // that stack's index in the worker's set
  uint3 tid;
  unsigned linear, lane, warp;
  FiberState state;
  // What the fiber is blocked in (kOpNone when running or runnable) and its arguments.
  Op op;
  int size;  // bytes of a shuffled value (a shuffle of float and one of double do not match)
  const char* file;
  int line;
  unsigned mask;
  int arg, width;
  unsigned long long value, result;
  // Its async-copy queue: null until the thread's first __pipeline_* call in this block, so that a
  // kernel without async copies pays one store per thread and block and one test at its exit.
  Pipeline* pipe;
#if defined(__SANITIZE_ADDRESS__)
  void* asan_fake_stack;  // ASan's bookkeeping for the fiber while it is switched out
#endif
};

struct WarpState {
  unsigned present;  // lanes that exist (the last warp of a block may be partial)
  unsigned exited;   // lanes that have returned
  unsigned waiting;  // lanes blocked in a warp collective
};

// A set of fiber stacks in one mapping, each with a guard page below it; pooled across launches.
struct StackSet {
  char* base;
  size_t count;
  StackSet* next;
};

struct Worker {
  void* scheduler_sp;  // where a fiber switches to when it blocks or ends
  Launch* launch;
  Fiber* current;
  Fiber* fibers;
  WarpState* warps;
  unsigned* order;  // sweep order: indices into fibers
  unsigned num_threads, num_warps;
  StackSet* stacks;
  unsigned* free_stacks;  // indices into `stacks` that no fiber of the block holds (a LIFO)
  unsigned num_free_stacks;
  unsigned runner_stack;  // the stack of the runner being started (see "Fibers")
  unsigned sweep;         // position in `order` of the fiber a runner runs
  unsigned char* dynamic_shared;
  size_t dynamic_shared_bytes;
  unsigned char* static_shared;  // this OS thread's copy of the module's thread-local storage
  size_t static_shared_bytes;
  Pipeline** pipelines;  // one slot per thread of the block, allocated at first use
  // Block-wide barrier (__syncthreads and friends).
  unsigned live;        // fibers that have not returned
  unsigned at_barrier;  // fibers blocked in the barrier
  unsigned barrier_count;
  const char* barrier_file;
  int barrier_line;
  bool restart;  // set when a barrier opens: the next sweep starts again at order[0]
  bool aborted;  // the launch failed in this block; stop running its fibers
#if defined(__SANITIZE_ADDRESS__)
  const void* asan_scheduler_bottom;  // the worker's own stack, as ASan reports it
  size_t asan_scheduler_size;
#endif
};

static __thread Worker* tls_worker;

// ---- Stacks -------------------------------------------------------------------------------------
// A worker holds one stack per thread of the block, but they are handed out from a free list
// (a LIFO): a runner (see "Fibers") takes one when it starts, a fiber that blocks keeps its
// runner's stack until it returns (every blocked fiber has one of its own), and a stack goes back
// to the list when its fiber or runner ends. A kernel whose threads never block runs them all on
// one stack whose top lines stay in L1 (stacks a fixed 132 KiB apart map their tops to the same
// L1 set: 32 of them took turns evicting each other).
//
// One pool of stack sets per process (per stack size), not one per library: module.py hands every
// library it loads the pool functions of the first library it loaded with the same kStackBytes
// (cupaged_cpu_share_stacks), and a worker takes a set for one launch and gives it back at its
// end. Each stack costs two mappings (guard and stack); hundreds of kernel libraries in one
// process, each keeping a set per OS thread, would exhaust vm.max_map_count (65,530 by default).
static pthread_mutex_t stack_pool_mutex = PTHREAD_MUTEX_INITIALIZER;
static StackSet* stack_pool;

static StackSet* pool_acquire_stacks(size_t count) {
  pthread_mutex_lock(&stack_pool_mutex);
  StackSet** link = &stack_pool;
  while (*link != nullptr && (*link)->count < count) link = &(*link)->next;
  StackSet* set = *link;
  if (set != nullptr) *link = set->next;
  pthread_mutex_unlock(&stack_pool_mutex);
  if (set != nullptr) return set;

  const size_t stride = kGuardBytes + kStackBytes;
  void* base = mmap(nullptr, stride * count, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  for (size_t i = 0; i < count; ++i) {
    mprotect(static_cast<char*>(base) + i * stride, kGuardBytes, PROT_NONE);
  }
  set = static_cast<StackSet*>(malloc(sizeof(StackSet)));
  if (set == nullptr) {
    munmap(base, stride * count);
    return nullptr;
  }
  set->base = static_cast<char*>(base);
  set->count = count;
  set->next = nullptr;
  return set;
}

static void pool_release_stacks(StackSet* set) {
  pthread_mutex_lock(&stack_pool_mutex);
  set->next = stack_pool;
  stack_pool = set;
  pthread_mutex_unlock(&stack_pool_mutex);
}

// This library's pool, or the one it was told to share (set before its first launch).
static StackSet* (*acquire_stacks_fn)(size_t) = pool_acquire_stacks;
static void (*release_stacks_fn)(StackSet*) = pool_release_stacks;

static StackSet* acquire_stacks(size_t count) { return acquire_stacks_fn(count); }

static void release_stacks(StackSet* set) {
  if (set != nullptr) release_stacks_fn(set);
}

// ---- Errors ---------------------------------------------------------------------------------
// A small bounded string builder for error messages (no iostreams: they slow every build).
struct Text {
  char* buf;
  size_t cap, len;
  void add(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
    if (len + 1 >= cap) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + len, cap - len, fmt, ap);
    va_end(ap);
    if (n > 0) len = (len + static_cast<size_t>(n) < cap) ? len + n : cap - 1;
  }
};

static const char* base_name(const char* path) {
  const char* slash = strrchr(path, '/');
  return slash != nullptr ? slash + 1 : path;
}

static const char* op_name(Op op) {
  switch (op) {
    case kOpSyncthreads: return "__syncthreads";
    case kOpSyncwarp: return "__syncwarp";
    case kOpShfl: return "__shfl_sync";
    case kOpShflUp: return "__shfl_up_sync";
    case kOpShflDown: return "__shfl_down_sync";
    case kOpShflXor: return "__shfl_xor_sync";
    case kOpBallot: return "__ballot_sync";
    case kOpAny: return "__any_sync";
    case kOpAll: return "__all_sync";
    case kOpWmmaLoad: return "wmma::load_matrix_sync";
    case kOpWmmaStore: return "wmma::store_matrix_sync";
    case kOpWmmaMma: return "wmma::mma_sync";
    case kOpLdmatrix: return "ldmatrix.sync.aligned.m8n8";
    case kOpMmaSync: return "mma.sync.aligned.m16n8k16";
    default: return "(nothing)";
  }
}

// Claims the launch's single error slot; false when another worker failed first.
static bool claim_error(Launch* launch) {
  int expected = 0;
  return __atomic_compare_exchange_n(&launch->failed, &expected, 1, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE);
}

static Text error_text(Launch* launch) { return Text{launch->error, launch->error_len, 0}; }

// "block (1,0,0), thread (5,0,0)"
static void add_where(Text& t, const Fiber* f) {
  t.add("block (%u,%u,%u), thread (%u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z, f->tid.x,
        f->tid.y, f->tid.z);
}

// ---- Switching between the scheduler and a fiber ----------------------------------------------
// Three kinds of switch. Under AddressSanitizer each one tells ASan which stack is about to run
// (otherwise it takes the new stack for an overflow of the old one).

// Scheduler -> a fiber (or a runner, see "Fibers") that runs on the stack ending at
// `stack_top`, until it blocks, returns or fails.
static void resume_fiber(Worker* w, void* sp, char* stack_top) {
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, stack_top - kStackBytes, kStackBytes);
  cupaged_cpu_to_fiber(&w->scheduler_sp, sp);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  (void)stack_top;
  cupaged_cpu_to_fiber(&w->scheduler_sp, sp);
#endif
}

// Fiber -> scheduler, to be resumed later at this point.
static void yield_to_scheduler(Worker* w, Fiber* f) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(&f->asan_fake_stack, w->asan_scheduler_bottom,
                                 w->asan_scheduler_size);
  cupaged_cpu_to_scheduler(&f->sp, w->scheduler_sp);
  __sanitizer_finish_switch_fiber(f->asan_fake_stack, &w->asan_scheduler_bottom,
                                  &w->asan_scheduler_size);
#else
  cupaged_cpu_to_scheduler(&f->sp, w->scheduler_sp);
#endif
}

// Fiber -> scheduler, for good (the fiber returned, or the launch failed in it). Its stack is
// reinitialised for the next block.
[[noreturn]] static void leave_fiber(Worker* w) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(nullptr, w->asan_scheduler_bottom, w->asan_scheduler_size);
#endif
  void* dead_sp;
  cupaged_cpu_to_scheduler(&dead_sp, w->scheduler_sp);
  __builtin_unreachable();
}

// Ends the current fiber because the launch failed: the scheduler sees `aborted` and abandons
// the block (the other fibers' stacks too).
[[noreturn]] static void abandon_fiber(Worker* w) {
  w->aborted = true;
  leave_fiber(w);
}

[[noreturn]] static void fail_fiber(Worker* w, const char* what_fmt, const char* a, const char* b) {
  if (claim_error(w->launch)) {
    Text t = error_text(w->launch);
    t.add(what_fmt, a, b);
    t.add(" in %s, ", w->launch->kernel->name);
    add_where(t, w->current);
  }
  abandon_fiber(w);
}

// ---- Asynchronous copies (cuda_pipeline_primitives.h; shim.h section 11) ----------------------
// Per CUDA thread, a queue of the copies it issued: the source bytes are read at issue and the
// destination is poisoned; a wait lands the completed batches in issue order. The queue grows by
// doubling up to kMaxPendingCopies (16 KiB in 16-byte copies from one thread, far more than the
// few stages of a pipeline keep in flight: more is a missing wait, not a deep pipeline).
constexpr unsigned kMaxPendingCopies = 1024;
constexpr size_t kMaxWaitPrior = 8;  // cuda_pipeline_primitives.h treats a larger N as 8

[[noreturn]] __attribute__((format(printf, 5, 6))) static void fail_pipeline(
    Worker* w, const char* call, const char* file, int line, const char* fmt, ...) {
  if (claim_error(w->launch)) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    Text t = error_text(w->launch);
    t.add("%s in %s at %s:%d: %s; ", call, w->launch->kernel->name, base_name(file), line, what);
    add_where(t, w->current);
  }
  abandon_fiber(w);
}

static bool in_range(const void* p, size_t n, const unsigned char* base, size_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(base);
  return base != nullptr && a >= b && a - b <= bytes && n <= bytes - (a - b);
}

// True when [p, p + n) lies in the block's dynamic shared memory or in the static __shared__
// variables (this OS thread's copy of the module's thread-local storage).
static bool in_shared(const Worker* w, const void* p, size_t n) {
  return in_range(p, n, w->dynamic_shared, w->dynamic_shared_bytes) ||
         in_range(p, n, w->static_shared, w->static_shared_bytes);
}

bool in_shared_memory(const void* p, size_t bytes) { return in_shared(tls_worker, p, bytes); }

static Pipeline* fiber_pipeline(Worker* w, const char* call, const char* file, int line) {
  Fiber* f = w->current;
  if (f->pipe != nullptr) return f->pipe;
  Pipeline* p = w->pipelines[f->linear];
  if (p == nullptr) {
    p = static_cast<Pipeline*>(calloc(1, sizeof(Pipeline)));
    if (p == nullptr) fail_pipeline(w, call, file, line, "out of memory for the copy queue");
    w->pipelines[f->linear] = p;
  }
  p->count = 0;
  p->commits = 0;
  f->pipe = p;
  return p;
}

void pipeline_memcpy_async(void* dst_shared, const void* src_global, size_t size, size_t zfill,
                           const char* file, int line) {
  Worker* w = tls_worker;
  const char* call = "__pipeline_memcpy_async";
  if (size != 4 && size != 8 && size != 16) {
    fail_pipeline(w, call, file, line, "size_and_align %zu, expected 4, 8 or 16", size);
  }
  if (zfill > size) {
    fail_pipeline(w, call, file, line, "zfill %zu, expected at most size_and_align (%zu)", zfill,
                  size);
  }
  const uintptr_t dst = reinterpret_cast<uintptr_t>(dst_shared);
  const uintptr_t src = reinterpret_cast<uintptr_t>(src_global);
  if ((dst | src) & (size - 1)) {
    fail_pipeline(w, call, file, line,
                  "dst_shared %p and src_global %p must both be aligned to size_and_align (%zu "
                  "bytes)",
                  dst_shared, src_global, size);
  }
  if (!in_shared(w, dst_shared, size)) {
    fail_pipeline(w, call, file, line, "dst_shared %p is not in the block's shared memory",
                  dst_shared);
  }
  if (in_shared(w, src_global, 1)) {
    fail_pipeline(w, call, file, line, "src_global %p is shared memory, expected global memory",
                  src_global);
  }
  Pipeline* p = fiber_pipeline(w, call, file, line);
  if (p->count == p->capacity) {
    if (p->capacity == kMaxPendingCopies) {
      fail_pipeline(w, call, file, line,
                    "%u copies of this thread pending, the first issued at %s:%d; a "
                    "__pipeline_commit/__pipeline_wait_prior missing?",
                    p->count, base_name(p->copies[0].file), p->copies[0].line);
    }
    const unsigned capacity = p->capacity == 0 ? 16 : 2 * p->capacity;
    void* grown = realloc(p->copies, capacity * sizeof(AsyncCopy));
    if (grown == nullptr) fail_pipeline(w, call, file, line, "out of memory for the copy queue");
    p->copies = static_cast<AsyncCopy*>(grown);
    p->capacity = capacity;
  }
  AsyncCopy& c = p->copies[p->count++];
  const size_t copied = size - zfill;
  memcpy(c.data, src_global, copied);
  memset(c.data + copied, 0, zfill);
  c.dst = static_cast<unsigned char*>(dst_shared);
  c.file = file;
  c.line = line;
  c.batch = p->commits;
  c.bytes = static_cast<unsigned>(size);
  memset(dst_shared, 0xff, size);  // undefined until the wait: the poison shows any early read
}

void pipeline_commit(const char* file, int line) {
  ++fiber_pipeline(tls_worker, "__pipeline_commit", file, line)->commits;
}

void pipeline_wait_prior(size_t prior) {
  Pipeline* p = tls_worker->current->pipe;
  if (p == nullptr || p->count == 0) return;
  if (prior > kMaxWaitPrior) prior = kMaxWaitPrior;
  if (p->commits <= prior) return;
  const unsigned limit = p->commits - static_cast<unsigned>(prior);  // batches below it complete
  unsigned k = 0;
  for (; k < p->count && p->copies[k].batch < limit; ++k) {
    memcpy(p->copies[k].dst, p->copies[k].data, p->copies[k].bytes);
  }
  if (k == 0) return;
  p->count -= k;
  memmove(p->copies, p->copies + k, p->count * sizeof(AsyncCopy));
}

// A thread that returns with copies pending: on the GPU they land at some later moment, over
// shared memory that the block may read or reuse, so a kernel must wait for every copy it issues.
[[noreturn]] static void fail_pending_copies(Worker* w, Fiber* f) {
  const Pipeline* p = f->pipe;
  fail_pipeline(w, "thread exit", p->copies[0].file, p->copies[0].line,
                "%u async cop%s (the first issued here) never completed by a "
                "__pipeline_wait_prior; end the pipeline with __pipeline_wait_prior(0)",
                p->count, p->count == 1 ? "y" : "ies");
}

// ---- Fibers -------------------------------------------------------------------------------------
static void release_barrier(Worker* w) {
  const unsigned long long result =
      w->barrier_count | (static_cast<unsigned long long>(w->at_barrier) << 32);
  for (unsigned i = 0; i < w->num_threads; ++i) {
    Fiber& f = w->fibers[i];
    if (f.op == kOpSyncthreads) {
      f.op = kOpNone;
      f.state = kRunnable;
      f.result = result;
    }
  }
  w->at_barrier = 0;
  w->restart = true;
}

// A fiber returned from the kernel.
static void retire_fiber(Worker* w, Fiber* f) {
  if (f->pipe != nullptr && f->pipe->count != 0) fail_pending_copies(w, f);
  f->state = kExited;
  w->warps[f->warp].exited |= 1u << f->lane;
  --w->live;
  // A barrier counts only live threads (Volta semantics): this exit may be what opens it.
  if (w->at_barrier != 0 && w->at_barrier == w->live) release_barrier(w);
}

static char* stack_top(const Worker* w, unsigned index) {
  return w->stacks->base + index * (kGuardBytes + kStackBytes) + kGuardBytes + kStackBytes;
}

// Where fibers start. The scheduler switches to a runner, on a stack of its own, when its sweep
// meets a fiber that has not run yet (sp null); the runner calls the kernel for it, and, when
// the kernel returns, goes on directly with the next fibers of the sweep while they have not run
// yet either: a fiber that never blocks costs a function call, no switch. A fiber that blocks
// takes the runner's stack for its own (its frames lie on top of the runner's) and switches to
// the scheduler, which goes on with the sweep and starts another runner for the next new fiber;
// when that fiber is resumed and returns, it lands in its old runner, which retires it and ends.
// The order in which CUDA threads run is exactly the sweep's.
static void runner_main(Worker* w) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &w->asan_scheduler_bottom, &w->asan_scheduler_size);
#endif
  const unsigned stack = w->runner_stack;
  char* const top = stack_top(w, stack);
  const KernelEntry* k = w->launch->kernel;
  for (;;) {
    Fiber* f = w->current;  // set by the scheduler, or below; w->sweep is its index in order
    f->stack = stack;
    f->stack_top = top;
    k->thunk(k->function, w->launch->args);
    retire_fiber(w, f);
    const bool blocked = f->sp != nullptr;  // this stack has been f's since; the sweep went on
    unsigned next = w->sweep + 1;
    if (blocked || w->restart || next >= w->num_threads) break;
    Fiber* g = &w->fibers[w->order[next]];
    if (g->sp != nullptr || g->state != kRunnable) break;  // the scheduler resumes that one
    w->sweep = next;
    w->current = g;
    threadIdx = g->tid;
  }
  // The next runner takes this stack (still in use until the switch below, but nothing else
  // runs on this OS thread before it).
  w->free_stacks[w->num_free_stacks++] = stack;
  leave_fiber(w);
}

// A runner for the fiber at sweep position `k`, on the stack the last fiber or runner to end
// left, while its cache lines and TLB entry are still hot. Returns the runner's stack pointer.
static void* start_runner(Worker* w, unsigned k) {
  // n fibers and n stacks: one is free whenever a fiber that holds none is about to start.
  const unsigned index = w->free_stacks[--w->num_free_stacks];
  w->runner_stack = index;
  w->sweep = k;
  char* top = stack_top(w, index);
#if defined(__SANITIZE_ADDRESS__)
  // Frames left on this stack by an earlier fiber (a fiber's last frame never returns, and a
  // failed launch abandons whole call chains) keep their redzones poisoned: clear the shadow of
  // the whole stack (64 KiB of shadow per runner; sanitizer builds only).
  __asan_unpoison_memory_region(top - kStackBytes, kStackBytes);
#endif
  // Frame read by to_fiber, from the saved stack pointer up: r15, r14, r13 (argument), r12
  // (function), rbx, rbp, the address jumped to (fiber_entry). It ends at the 16-byte aligned
  // stack top, so that fiber_entry's call meets the ABI's alignment.
  unsigned long long* frame = reinterpret_cast<unsigned long long*>(top - 56);
  frame[0] = 0;                                                   // r15
  frame[1] = 0;                                                   // r14
  frame[2] = reinterpret_cast<unsigned long long>(w);             // r13
  frame[3] = reinterpret_cast<unsigned long long>(&runner_main);  // r12
  frame[4] = 0;                                                   // rbx
  frame[5] = 0;                                                   // rbp (ends backtraces)
  frame[6] = reinterpret_cast<unsigned long long>(&cupaged_cpu_fiber_entry);
  return frame;
}

// ---- Barrier and warp collectives (called from kernel code) -----------------------------------
int block_barrier(BarrierKind kind, int predicate, const char* file, int line) {
  Worker* w = tls_worker;
  Fiber* f = w->current;
  if (w->at_barrier == 0) {
    w->barrier_file = file;
    w->barrier_line = line;
    w->barrier_count = 0;
  } else if (w->launch->strict &&
             (line != w->barrier_line ||
              (file != w->barrier_file && strcmp(file, w->barrier_file) != 0))) {
    // Two call sites meet: legal on Volta+ hardware, but almost always a bug (a __syncthreads
    // inside a branch that not every thread takes).
    if (claim_error(w->launch)) {
      Text t = error_text(w->launch);
      t.add("divergent __syncthreads in %s: ", w->launch->kernel->name);
      add_where(t, f);
      t.add(" reached the barrier at %s:%d while ", base_name(file), line);
      t.add("%u thread(s) wait at %s:%d", w->at_barrier, base_name(w->barrier_file),
            w->barrier_line);
    }
    abandon_fiber(w);
  }
  f->op = kOpSyncthreads;
  f->file = file;
  f->line = line;
  f->state = kBlocked;
  w->barrier_count += predicate != 0;
  ++w->at_barrier;
  if (w->at_barrier == w->live) release_barrier(w);  // the last one in: everyone may go on
  // Even the last one in yields, so that the next phase starts with order[0] again.
  yield_to_scheduler(w, f);
  const unsigned count = static_cast<unsigned>(f->result);
  const unsigned participants = static_cast<unsigned>(f->result >> 32);
  switch (kind) {
    case kBarCount: return static_cast<int>(count);
    case kBarAnd: return count == participants;
    case kBarOr: return count != 0;
    default: return 0;
  }
}

// Source lane of a shuffle, following PTX's shfl.sync (c = clamp / segment mask as CUDA sets it);
// -1 when the lane keeps its own value.
static int shuffle_source(Op op, int lane, int arg, int width) {
  const int seg_mask = (32 - width) & 31;
  const int min_lane = lane & seg_mask;
  const int max_lane = min_lane | (31 & ~seg_mask);
  int j;
  bool valid;
  switch (op) {
    case kOpShflUp:
      j = lane - arg;
      valid = j >= min_lane;
      break;
    case kOpShflDown:
      j = lane + arg;
      valid = j <= max_lane;
      break;
    case kOpShflXor:
      j = lane ^ arg;
      valid = j <= max_lane;
      break;
    default:  // kOpShfl
      j = min_lane | (arg & ~seg_mask & 31);
      valid = j <= max_lane;
      break;
  }
  return valid ? j : -1;
}

// Runs once every lane of `caller->mask` waits in a collective with that same mask: checks that
// they all called the same collective, computes every lane's result and wakes them. Returns false
// (nothing done) while some lane of the mask waits in a collective with a different mask.
static bool complete_collective(Worker* w, Fiber* caller) {
  const unsigned mask = caller->mask;
  Fiber* lanes = w->fibers + caller->warp * 32;
  for (unsigned m = mask; m != 0; m &= m - 1) {
    const Fiber& g = lanes[__builtin_ctz(m)];
    if (g.mask != mask) return false;
  }
  for (unsigned m = mask; m != 0; m &= m - 1) {
    const Fiber& g = lanes[__builtin_ctz(m)];
    if (g.op != caller->op || g.size != caller->size) {
      if (claim_error(w->launch)) {
        Text t = error_text(w->launch);
        t.add("mismatched warp collectives in %s, block (%u,%u,%u), warp %u: lane %u calls %s "
              "(%s:%d) while lane %u calls %s (%s:%d) with the same mask 0x%08x",
              w->launch->kernel->name, blockIdx.x, blockIdx.y, blockIdx.z, caller->warp, g.lane,
              op_name(g.op), base_name(g.file), g.line, caller->lane, op_name(caller->op),
              base_name(caller->file), caller->line, mask);
      }
      abandon_fiber(w);
    }
  }
  const Op op = caller->op;
  if (op >= kOpWmmaLoad) {
    // A WMMA, ldmatrix or mma.sync operation (shim.h sections 12 and 13): the last lane in runs
    // it for the whole warp.
    WmmaRequest* requests[32];
    for (unsigned l = 0; l < 32; ++l) {
      requests[l] = reinterpret_cast<WmmaRequest*>(static_cast<uintptr_t>(lanes[l].value));
    }
    if (const char* error = requests[0]->complete(requests)) {
      if (claim_error(w->launch)) {
        Text t = error_text(w->launch);
        t.add("%s in %s at %s:%d: %s; block (%u,%u,%u), warp %u", op_name(op),
              w->launch->kernel->name, base_name(caller->file), caller->line, error, blockIdx.x,
              blockIdx.y, blockIdx.z, caller->warp);
      }
      abandon_fiber(w);
    }
  } else if (op == kOpBallot || op == kOpAny || op == kOpAll) {
    unsigned ballot = 0;
    for (unsigned m = mask; m != 0; m &= m - 1) {
      const unsigned l = __builtin_ctz(m);
      if (lanes[l].value != 0) ballot |= 1u << l;
    }
    const unsigned long long r =
        op == kOpBallot ? ballot : op == kOpAny ? ballot != 0 : ballot == mask;
    for (unsigned m = mask; m != 0; m &= m - 1) lanes[__builtin_ctz(m)].result = r;
  } else if (op != kOpSyncwarp) {
    for (unsigned m = mask; m != 0; m &= m - 1) {
      Fiber& g = lanes[__builtin_ctz(m)];
      const int src = shuffle_source(op, static_cast<int>(g.lane), g.arg, g.width);
      if (src < 0) {
        g.result = g.value;
      } else if (mask >> src & 1) {
        g.result = lanes[src].value;
      } else {
        // Reading a lane outside the mask is undefined on the GPU: all-ones bits (NaN as a
        // float, -1 as an integer) make a kernel that uses the value visibly wrong.
        g.result = ~0ull;
      }
    }
  }
  w->warps[caller->warp].waiting &= ~mask;
  for (unsigned m = mask; m != 0; m &= m - 1) {
    Fiber& g = lanes[__builtin_ctz(m)];
    g.op = kOpNone;
    g.state = kRunnable;
  }
  return true;
}

unsigned long long warp_collective(Op op, unsigned mask, unsigned long long value, int arg,
                                   int width, int size, const char* file, int line) {
  Worker* w = tls_worker;
  Fiber* f = w->current;
  const unsigned bit = 1u << f->lane;
  if ((mask & bit) == 0) {
    char m[16];
    snprintf(m, sizeof m, "0x%08x", mask);
    fail_fiber(w, "%s called with mask %s, which does not include the calling lane", op_name(op),
               m);
  }
  const bool shuffle = op >= kOpShfl && op <= kOpShflXor;
  if (shuffle && (width < 1 || width > 32 || (width & (width - 1)) != 0)) {
    fail_fiber(w, "%s called with width %s, expected a power of two from 1 to 32", op_name(op),
               width < 1 ? "< 1" : "> 32 or not a power of two");
  }
  f->op = op;
  f->mask = mask;
  f->value = value;
  f->arg = arg;
  f->width = width;
  f->size = size;
  f->file = file;
  f->line = line;
  WarpState& ws = w->warps[f->warp];
  ws.waiting |= bit;
  // The last lane in completes the collective and runs on without a switch.
  if ((ws.waiting & mask) == mask && complete_collective(w, f)) return f->result;
  f->state = kBlocked;
  yield_to_scheduler(w, f);
  return f->result;
}

unsigned current_lane() { return tls_worker->current->lane; }

// A malformed WMMA call (shim.h section 12): misaligned tile, bad leading dimension.
void wmma_fail(const char* call, const char* file, int line, const char* what) {
  fail_pipeline(tls_worker, call, file, line, "%s", what);
}

unsigned active_mask() {
  Worker* w = tls_worker;
  const WarpState& ws = w->warps[w->current->warp];
  return ws.present & ~ws.exited;
}

void assert_fail(const char* expr, const char* file, int line, const char* function) {
  Worker* w = tls_worker;
  if (claim_error(w->launch)) {
    Text t = error_text(w->launch);
    t.add("device assertion `%s` failed in %s at %s:%d (%s), ", expr, w->launch->kernel->name,
          base_name(file), line, function);
    add_where(t, w->current);
  }
  abandon_fiber(w);
}

}  // namespace cupaged_cpu

void* cupaged_cpu_dynamic_shared() { return cupaged_cpu::tls_worker->dynamic_shared; }

namespace cupaged_cpu {

// ---- Deadlock report ----------------------------------------------------------------------------
// "thread(s) 0-30" from a list of linear thread ids, in ranges, shortened after a few.
static void add_thread_list(Text& t, const unsigned* ids, unsigned n) {
  t.add(n == 1 ? "thread " : "threads ");
  unsigned shown = 0;
  for (unsigned i = 0; i < n;) {
    unsigned j = i;
    while (j + 1 < n && ids[j + 1] == ids[j] + 1) ++j;
    if (shown == 6) {
      t.add(", ...");
      break;
    }
    t.add(shown ? ", %u" : "%u", ids[i]);
    if (j > i) t.add("-%u", ids[j]);
    ++shown;
    i = j + 1;
  }
}

static void report_deadlock(Worker* w) {
  if (!claim_error(w->launch)) return;
  Text t = error_text(w->launch);
  t.add("deadlock in %s, block (%u,%u,%u) of %u threads, no thread can go on: ",
        w->launch->kernel->name, blockIdx.x, blockIdx.y, blockIdx.z, w->num_threads);
  // Group the blocked threads by (collective, call site, mask), in thread order.
  unsigned* ids = static_cast<unsigned*>(malloc(sizeof(unsigned) * w->num_threads));
  bool* done = static_cast<bool*>(calloc(w->num_threads, 1));
  bool first = true;
  for (unsigned i = 0; ids != nullptr && done != nullptr && i < w->num_threads; ++i) {
    const Fiber& a = w->fibers[i];
    if (done[i] || a.state != kBlocked) continue;
    const bool warp_level = a.op != kOpSyncthreads;
    unsigned n = 0;
    for (unsigned j = i; j < w->num_threads; ++j) {
      const Fiber& b = w->fibers[j];
      if (!done[j] && b.state == kBlocked && b.op == a.op && b.line == a.line &&
          strcmp(b.file, a.file) == 0 && (!warp_level || (b.warp == a.warp && b.mask == a.mask))) {
        done[j] = true;
        ids[n++] = b.linear;
      }
    }
    t.add("%s%u thread%s wait%s at %s (%s:%d)", first ? "" : "; ", n, n == 1 ? "" : "s",
          n == 1 ? "s" : "", op_name(a.op), base_name(a.file), a.line);
    first = false;
    if (warp_level) t.add(" with mask 0x%08x", a.mask);
    t.add(" [");
    add_thread_list(t, ids, n);
    t.add("]");
    if (!warp_level) continue;
    // The usual culprit: a lane named in the mask that returned, or that does not exist.
    const WarpState& ws = w->warps[a.warp];
    n = 0;
    for (unsigned m = a.mask & ws.exited; m != 0; m &= m - 1) {
      ids[n++] = a.warp * 32 + __builtin_ctz(m);
    }
    if (n != 0) {
      t.add(", but ");
      add_thread_list(t, ids, n);
      t.add(n == 1 ? " in that mask has exited" : " in that mask have exited");
    }
    const unsigned missing = a.mask & ~ws.present;
    if (missing != 0) {
      t.add(", but lanes 0x%08x of that mask do not exist (the block has %u threads)", missing,
            w->num_threads);
    }
  }
  free(ids);
  free(done);
}

// ---- Shared memory poison -------------------------------------------------------------------
// Static __shared__ arrays are thread-local variables of this library, so this OS thread's copy
// of the library's TLS segment holds every one of them (for every kernel of the module). Filling
// it with 0xFF bytes before each block makes a read of shared memory that nothing wrote in this
// block NaN (or -1), as for dynamic shared memory, instead of the previous block's plausible
// values. The runtime's own thread-locals live in the same segment and are saved around the fill.
static int find_tls_segment(dl_phdr_info* info, size_t, void* out) {
  const uintptr_t probe = reinterpret_cast<uintptr_t>(&find_tls_segment);
  const ElfW(Phdr)* tls = nullptr;
  bool here = false;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    const uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (ph.p_type == PT_LOAD && probe >= start && probe < start + ph.p_memsz) here = true;
    if (ph.p_type == PT_TLS) tls = &ph;
  }
  if (!here) return 0;
  Worker* w = static_cast<Worker*>(out);
  if (tls != nullptr && info->dlpi_tls_data != nullptr) {
    w->static_shared = static_cast<unsigned char*>(info->dlpi_tls_data);
    w->static_shared_bytes = tls->p_memsz;
  }
  return 1;
}

// The compiler cannot know that the fill writes the runtime's thread-locals (it goes through a
// pointer from dl_iterate_phdr): without this fence it would move the saves below the fill and
// drop the restores as redundant.
static inline void thread_locals_may_change() {
  asm volatile("" : : "r"(&threadIdx), "r"(&blockIdx), "r"(&blockDim), "r"(&gridDim),
               "r"(&tls_worker) : "memory");
}

static void poison_static_shared(Worker* w) {
  if (w->static_shared == nullptr) return;
  const uint3 saved_block_idx = blockIdx;
  const dim3 saved_block_dim = blockDim, saved_grid_dim = gridDim;
  thread_locals_may_change();
  memset(w->static_shared, 0xff, w->static_shared_bytes);
  thread_locals_may_change();
  threadIdx = uint3{0, 0, 0};
  blockIdx = saved_block_idx;
  blockDim = saved_block_dim;
  gridDim = saved_grid_dim;
  tls_worker = w;
}

// ---- Scheduler ----------------------------------------------------------------------------------
static void build_order(Worker* w, Schedule schedule) {
  const unsigned n = w->num_threads;
  for (unsigned i = 0; i < n; ++i) {
    switch (schedule) {
      case kReverse:
        w->order[i] = n - 1 - i;
        break;
      case kWarpAhead: {
        // The last warp first, then the others in order: one warp runs a phase ahead.
        const unsigned last = (n - 1) / 32 * 32, tail = n - last;
        w->order[i] = i < tail ? last + i : i - tail;
        break;
      }
      default:
        w->order[i] = i;
    }
  }
}

// Runs one block to completion; false when the launch failed (here or in another worker).
static bool run_block(Worker* w, unsigned long long block) {
  Launch* L = w->launch;
  blockIdx.x = static_cast<unsigned>(block % L->grid.x);
  blockIdx.y = static_cast<unsigned>(block / L->grid.x % L->grid.y);
  blockIdx.z = static_cast<unsigned>(block / (1ull * L->grid.x * L->grid.y));
  if (w->dynamic_shared_bytes != 0) memset(w->dynamic_shared, 0xff, w->dynamic_shared_bytes);
  poison_static_shared(w);
  for (unsigned i = 0; i < w->num_threads; ++i) {
    Fiber* f = &w->fibers[i];
    f->state = kRunnable;
    f->op = kOpNone;
    f->pipe = nullptr;
    f->sp = nullptr;
  }
  // Every stack is free again (a failed block's fibers are abandoned, never resumed); stack 0 on
  // top of the free list.
  for (unsigned i = 0; i < w->num_threads; ++i) w->free_stacks[i] = w->num_threads - 1 - i;
  w->num_free_stacks = w->num_threads;
  for (unsigned i = 0; i < w->num_warps; ++i) {
    w->warps[i].exited = 0;
    w->warps[i].waiting = 0;
  }
  w->live = w->num_threads;
  w->at_barrier = 0;
  w->restart = false;
  w->aborted = false;

  const unsigned n = w->num_threads;
  for (;;) {
    bool ran = false;
    for (unsigned k = 0; k < n; ++k) {
      Fiber* f = &w->fibers[w->order[k]];
      if (f->state != kRunnable) continue;
      ran = true;
      w->current = f;
      threadIdx = f->tid;
      if (f->sp == nullptr) {
        void* sp = start_runner(w, k);
        resume_fiber(w, sp, stack_top(w, w->runner_stack));
        k = w->sweep;  // the runner may have run the fibers after k too
      } else {
        resume_fiber(w, f->sp, f->stack_top);
      }
      if (w->aborted) return false;
      if (w->restart) {
        w->restart = false;
        k = ~0u;  // next iteration: order[0]
      }
    }
    if (w->live == 0) return true;
    if (!ran) {
      report_deadlock(w);
      return false;
    }
    if (__atomic_load_n(&L->failed, __ATOMIC_RELAXED)) return false;
  }
}

// ---- Per-thread worker buffers ------------------------------------------------------------------
// Fibers, warp states, the sweep order, the fiber stacks, the dynamic shared memory and the
// address of this OS thread's TLS segment are kept per OS thread and reused by every launch:
// allocating them and finding the TLS segment (dl_iterate_phdr walks every loaded object) cost
// more than a small launch itself. They hang off a pthread key, not a thread_local: the module's
// TLS segment is overwritten with poison before each block.
struct ThreadCache {
  Fiber* fibers;
  WarpState* warps;
  unsigned* order;
  unsigned* free_stacks;
  Pipeline** pipelines;  // each allocated at its thread's first async copy, then kept
  unsigned capacity;     // threads the five arrays above hold
  StackSet* stacks;
  unsigned char* dynamic_shared;
  size_t dynamic_capacity;
  unsigned char* static_shared;
  size_t static_shared_bytes;
  bool tls_found;
};

static pthread_key_t thread_cache_key;
static pthread_once_t thread_cache_once = PTHREAD_ONCE_INIT;

static void free_thread_cache(void* p) {
  ThreadCache* c = static_cast<ThreadCache*>(p);
  if (c == nullptr) return;
  release_stacks(c->stacks);
  for (unsigned i = 0; c->pipelines != nullptr && i < c->capacity; ++i) {
    if (c->pipelines[i] != nullptr) free(c->pipelines[i]->copies);
    free(c->pipelines[i]);
  }
  free(c->pipelines);
  free(c->fibers);
  free(c->warps);
  free(c->order);
  free(c->free_stacks);
  free(c->dynamic_shared);
  free(c);
}

static void make_thread_cache_key() { pthread_key_create(&thread_cache_key, free_thread_cache); }

static ThreadCache* thread_cache() {
  pthread_once(&thread_cache_once, make_thread_cache_key);
  ThreadCache* c = static_cast<ThreadCache*>(pthread_getspecific(thread_cache_key));
  if (c == nullptr) {
    c = static_cast<ThreadCache*>(calloc(1, sizeof(ThreadCache)));
    if (c != nullptr && pthread_setspecific(thread_cache_key, c) != 0) {
      free(c);
      c = nullptr;
    }
  }
  return c;
}

// Grows the cache to `n` threads and `shared` bytes of dynamic shared memory; false when out of
// memory (the cache stays valid, with its old sizes).
static bool reserve_thread_cache(ThreadCache* c, unsigned n, size_t shared) {
  if (c->capacity < n) {
    Fiber* fibers = static_cast<Fiber*>(realloc(c->fibers, n * sizeof(Fiber)));
    if (fibers != nullptr) c->fibers = fibers;
    const unsigned warps = (n + 31) / 32;
    WarpState* ws = static_cast<WarpState*>(realloc(c->warps, warps * sizeof(WarpState)));
    if (ws != nullptr) c->warps = ws;
    unsigned* order = static_cast<unsigned*>(realloc(c->order, n * sizeof(unsigned)));
    if (order != nullptr) c->order = order;
    unsigned* free_stacks = static_cast<unsigned*>(realloc(c->free_stacks, n * sizeof(unsigned)));
    if (free_stacks != nullptr) c->free_stacks = free_stacks;
    Pipeline** pipes = static_cast<Pipeline**>(realloc(c->pipelines, n * sizeof(Pipeline*)));
    if (pipes != nullptr) {
      c->pipelines = pipes;
      memset(pipes + c->capacity, 0, (n - c->capacity) * sizeof(Pipeline*));
    }
    if (fibers == nullptr || ws == nullptr || order == nullptr || free_stacks == nullptr ||
        pipes == nullptr) {
      return false;
    }
    c->capacity = n;
  }
  if (c->stacks == nullptr || c->stacks->count < n) {
    StackSet* stacks = acquire_stacks(n);
    if (stacks == nullptr) return false;
    release_stacks(c->stacks);
    c->stacks = stacks;
  }
#if defined(__SANITIZE_ADDRESS__)
  // Exactly the requested bytes (rounded up to 16), so that ASan catches reads past the end.
  const bool regrow = c->dynamic_shared == nullptr || c->dynamic_capacity != shared;
#else
  const bool regrow = c->dynamic_shared == nullptr || c->dynamic_capacity < shared;
#endif
  if (regrow) {
    void* buffer = nullptr;
    if (posix_memalign(&buffer, 128, shared ? shared : 16) != 0) return false;
    free(c->dynamic_shared);
    c->dynamic_shared = static_cast<unsigned char*>(buffer);
    c->dynamic_capacity = shared;
  }
  return true;
}

static bool setup_worker(Worker* w, Launch* L, ThreadCache* c) {
  memset(w, 0, sizeof *w);
  w->launch = L;
  const unsigned n = L->threads_per_block;
  const size_t shared = (L->shared_bytes + 15) / 16 * 16;
  if (c == nullptr || !reserve_thread_cache(c, n, shared)) return false;
  w->num_threads = n;
  w->num_warps = (n + 31) / 32;
  w->fibers = c->fibers;
  w->warps = c->warps;
  w->order = c->order;
  w->free_stacks = c->free_stacks;
  w->pipelines = c->pipelines;
  w->stacks = c->stacks;
  w->dynamic_shared = c->dynamic_shared;
  w->dynamic_shared_bytes = shared;
  memset(w->fibers, 0, n * sizeof(Fiber));
  memset(w->warps, 0, w->num_warps * sizeof(WarpState));
  for (unsigned i = 0; i < n; ++i) {
    Fiber* f = &w->fibers[i];
    f->linear = i;
    f->lane = i % 32;
    f->warp = i / 32;
    f->tid.x = i % L->block.x;
    f->tid.y = i / L->block.x % L->block.y;
    f->tid.z = i / (L->block.x * L->block.y);
    w->warps[f->warp].present |= 1u << f->lane;
  }
  build_order(w, L->schedule);
  return true;
}

// Runs blocks of the launch on this OS thread until none is left or the launch failed; false when
// this thread's buffers could not be set up (its blocks are left to the other workers, or, for
// the calling thread, reported).
static bool run_worker(Launch* L) {
  ThreadCache* c = thread_cache();
  Worker w;
  if (!setup_worker(&w, L, c)) return false;
  Worker* saved = tls_worker;  // a launch from inside a kernel is not supported, but be safe
  tls_worker = &w;             // also makes sure this thread's copy of the TLS segment exists
  blockDim = L->block;
  gridDim = L->grid;
  if (!c->tls_found) {
    dl_iterate_phdr(find_tls_segment, &w);
    c->static_shared = w.static_shared;
    c->static_shared_bytes = w.static_shared_bytes;
    c->tls_found = true;
  }
  w.static_shared = c->static_shared;
  w.static_shared_bytes = c->static_shared_bytes;
  for (;;) {
    if (__atomic_load_n(&L->failed, __ATOMIC_RELAXED)) break;
    const unsigned long long b = __atomic_fetch_add(&L->next_block, 1, __ATOMIC_RELAXED);
    if (b >= L->num_blocks || !run_block(&w, b)) break;
  }
  tls_worker = saved;
  // Back to the process's pool (see "Stacks"): no fiber of this launch runs again (a failed
  // block's fibers are abandoned, never resumed).
  release_stacks(c->stacks);
  c->stacks = nullptr;
  return true;
}

// ---- Worker pool --------------------------------------------------------------------------------
// OS threads that help the calling thread with a launch's blocks, started on first need and kept
// (an idle one ends after kIdleSeconds). One launch at a time uses the pool; a launch made while
// another one holds it (from a second Python thread) runs on its calling thread alone. The caller
// posts the launch, runs blocks itself, then closes the launch and waits only for the helpers that
// joined it: a helper that wakes after the close never sees the launch, whose state lives on the
// caller's stack.
constexpr int kIdleSeconds = 5;

struct Pool {
  pthread_mutex_t mutex;
  pthread_cond_t wake;  // a launch was posted
  pthread_cond_t done;  // the last helper left a launch (broadcast: closers of several launches
                        // may wait at once, each for the helpers of its own launch)
  Launch* job;          // the open launch, or null
  unsigned long long generation;
  int seats;  // helpers that may still join the open launch
  int threads;
  int idle;
};

static Pool pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
                    nullptr, 0, 0, 0, 0};
static pthread_once_t pool_fork_once = PTHREAD_ONCE_INIT;

// A forked child has none of the parent's helper threads: start from an empty pool (and with
// unlocked mutexes: a thread that held one at the fork does not exist in the child).
static void reset_pool_in_child() {
  pthread_mutex_init(&stack_pool_mutex, nullptr);
  pthread_mutex_init(&pool.mutex, nullptr);
  pthread_cond_init(&pool.wake, nullptr);
  pthread_cond_init(&pool.done, nullptr);
  pool.job = nullptr;
  pool.seats = pool.threads = pool.idle = 0;
}

static void register_fork_handler() { pthread_atfork(nullptr, nullptr, reset_pool_in_child); }

static void* helper_main(void*) {
  pthread_mutex_lock(&pool.mutex);
  // No launch seen yet: a helper started by a post joins that very launch (the post bumps the
  // generation before this thread can take the mutex).
  unsigned long long seen = ~0ULL;
  for (;;) {
    while (pool.job == nullptr || pool.generation == seen || pool.seats == 0) {
      timespec deadline;
      clock_gettime(CLOCK_REALTIME, &deadline);
      deadline.tv_sec += kIdleSeconds;
      ++pool.idle;
      const int waited = pthread_cond_timedwait(&pool.wake, &pool.mutex, &deadline);
      --pool.idle;
      if (waited != 0 && (pool.job == nullptr || pool.generation == seen || pool.seats == 0)) {
        --pool.threads;
        pthread_mutex_unlock(&pool.mutex);
        return nullptr;
      }
    }
    seen = pool.generation;
    --pool.seats;
    Launch* L = pool.job;
    ++L->pool_helpers;
    pthread_mutex_unlock(&pool.mutex);
    run_worker(L);
    pthread_mutex_lock(&pool.mutex);
    // Once the count reaches 0 the closer may return and `L` (on its stack) is gone: no use of
    // `L` after this line. Another launch may have been posted meanwhile, with its own closer.
    if (--L->pool_helpers == 0) pthread_cond_broadcast(&pool.done);
  }
}

// Opens `L` to `helpers` pool threads (starting threads as needed); false when the pool is busy.
static bool post_to_pool(Launch* L, int helpers) {
  pthread_once(&pool_fork_once, register_fork_handler);
  pthread_mutex_lock(&pool.mutex);
  if (pool.job != nullptr) {
    pthread_mutex_unlock(&pool.mutex);
    return false;
  }
  while (pool.threads < helpers) {
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    const bool started = pthread_create(&thread, &attr, helper_main, nullptr) == 0;
    pthread_attr_destroy(&attr);
    if (!started) break;  // fewer helpers: the blocks counter is shared, nothing is lost
    ++pool.threads;
  }
  pool.job = L;
  ++pool.generation;
  pool.seats = helpers;
  if (pool.idle != 0) pthread_cond_broadcast(&pool.wake);
  pthread_mutex_unlock(&pool.mutex);
  return true;
}

static void close_pool_launch(Launch* L) {
  pthread_mutex_lock(&pool.mutex);
  if (pool.job == L) {  // still open: no helper may join any more
    pool.job = nullptr;
    pool.seats = 0;
  }
  while (L->pool_helpers != 0) pthread_cond_wait(&pool.done, &pool.mutex);
  pthread_mutex_unlock(&pool.mutex);
}

// 0: success; 1: the kernel failed (error says how); 2: the launch could not start.
static int launch(Launch* L, int num_workers) {
  if (num_workers < 1) num_workers = 1;
  if (static_cast<unsigned long long>(num_workers) > L->num_blocks)
    num_workers = static_cast<int>(L->num_blocks);
  const bool pooled = num_workers > 1 && post_to_pool(L, num_workers - 1);
  const bool ran = run_worker(L);
  if (pooled) close_pool_launch(L);
  if (!ran && L->next_block < L->num_blocks && !L->failed) {
    snprintf(L->error, L->error_len,
             "out of memory for %u fiber stacks of %zu KiB or %zu bytes of shared memory (%s)",
             L->threads_per_block, kStackBytes / 1024, L->shared_bytes, L->kernel->name);
    return 2;
  }
  return __atomic_load_n(&L->failed, __ATOMIC_ACQUIRE) ? 1 : 0;
}

}  // namespace cupaged_cpu

// ---- C entry points (called from Python through ctypes) -----------------------------------------
// The generated code defines the table, one entry per name expression, in the order given.
namespace cupaged_cpu {
extern const KernelEntry kernel_table[];
extern const int kernel_count;
}  // namespace cupaged_cpu

#define CUPAGED_CPU_EXPORT extern "C" __attribute__((visibility("default")))

// Bumped whenever these signatures change; the loader checks it.
CUPAGED_CPU_EXPORT int cupaged_cpu_abi_version() { return 2; }
// The process-wide stack pool (runtime.h, "Stacks"): this library's pool functions and stack
// size, and the setter that makes it use another library's pool of the same stack size.
CUPAGED_CPU_EXPORT size_t cupaged_cpu_stack_bytes() { return cupaged_cpu::kStackBytes; }
CUPAGED_CPU_EXPORT void* cupaged_cpu_stack_pool_acquire() {
  // The owner's fork handler re-initialises its pool mutex in a forked child.
  pthread_once(&cupaged_cpu::pool_fork_once, cupaged_cpu::register_fork_handler);
  return reinterpret_cast<void*>(&cupaged_cpu::pool_acquire_stacks);
}
CUPAGED_CPU_EXPORT void* cupaged_cpu_stack_pool_release() {
  return reinterpret_cast<void*>(&cupaged_cpu::pool_release_stacks);
}
CUPAGED_CPU_EXPORT void cupaged_cpu_share_stacks(void* acquire, void* release) {
  cupaged_cpu::acquire_stacks_fn = reinterpret_cast<cupaged_cpu::StackSet* (*)(size_t)>(acquire);
  cupaged_cpu::release_stacks_fn = reinterpret_cast<void (*)(cupaged_cpu::StackSet*)>(release);
}
CUPAGED_CPU_EXPORT int cupaged_cpu_kernel_count() { return cupaged_cpu::kernel_count; }
CUPAGED_CPU_EXPORT const char* cupaged_cpu_kernel_name(int i) {
  return cupaged_cpu::kernel_table[i].name;
}
CUPAGED_CPU_EXPORT int cupaged_cpu_param_count(int i) {
  return cupaged_cpu::kernel_table[i].num_params;
}
CUPAGED_CPU_EXPORT const size_t* cupaged_cpu_param_sizes(int i) {
  return cupaged_cpu::kernel_table[i].param_sizes;
}
CUPAGED_CPU_EXPORT const char* cupaged_cpu_param_kinds(int i) {
  return cupaged_cpu::kernel_table[i].param_kinds;
}

// One launch request, packed by the Python side in a single buffer (one foreign call, no
// per-argument conversions): this 64-byte header, then parameter i's value at offset 64 +
// sum over j < i of round_up(size_j, 16) (a pointer value for array arguments).
struct LaunchRequest {
  int32_t kernel;
  uint32_t grid[3];
  uint32_t block[3];
  int32_t schedule, workers, strict;
  uint64_t shared_mem;
  uint64_t values_bytes;
  char reserved[8];
};
static_assert(sizeof(LaunchRequest) == 64, "the Python side packs a 64-byte header");

// Runs the requested kernel over its grid and waits for it. Returns 0 on success, 1 when the
// kernel failed (deadlock, assert, divergent barrier, malformed collective) and 2 when the launch
// could not run (bad request, out of memory); for 1 and 2, `error` holds the message.
CUPAGED_CPU_EXPORT int cupaged_cpu_launch(const char* request, size_t request_bytes, char* error,
                                          size_t error_len) {
  using namespace cupaged_cpu;
  if (error_len != 0) error[0] = '\0';
  LaunchRequest r;
  if (request_bytes < sizeof r) {
    snprintf(error, error_len, "launch request of %zu bytes, expected at least %zu", request_bytes,
             sizeof r);
    return 2;
  }
  memcpy(&r, request, sizeof r);
  const unsigned gx = r.grid[0], gy = r.grid[1], gz = r.grid[2];
  const unsigned bx = r.block[0], by = r.block[1], bz = r.block[2];
  const unsigned long long threads = 1ull * bx * by * bz;
  if (r.kernel < 0 || r.kernel >= kernel_count) {
    snprintf(error, error_len, "kernel index %d out of range [0, %d)", r.kernel, kernel_count);
    return 2;
  }
  const KernelEntry* kernel = &kernel_table[r.kernel];
  size_t needed = 0;
  for (int i = 0; i < kernel->num_params; ++i) needed += (kernel->param_sizes[i] + 15) / 16 * 16;
  if (gx == 0 || gy == 0 || gz == 0 || threads == 0 || threads > kMaxThreadsPerBlock ||
      r.schedule < kForward || r.schedule > kWarpAhead || r.values_bytes != needed ||
      request_bytes != sizeof r + needed) {
    snprintf(error, error_len,
             "invalid launch of %s: grid (%u,%u,%u), block (%u,%u,%u), schedule %d, %zu bytes of "
             "arguments (expected non-empty dimensions, at most %u threads per block and %zu "
             "bytes of arguments)",
             kernel->name, gx, gy, gz, bx, by, bz, r.schedule, request_bytes - sizeof r,
             kMaxThreadsPerBlock, needed);
    return 2;
  }
  // The values, copied to a 16-byte aligned buffer so that the thunk reads any type in place.
  alignas(16) char local[512];
  char* values = local;
  if (needed > sizeof local) {
    void* heap = nullptr;
    if (posix_memalign(&heap, 16, needed) != 0) {
      snprintf(error, error_len, "out of memory for the arguments of %s", kernel->name);
      return 2;
    }
    values = static_cast<char*>(heap);
  }
  memcpy(values, request + sizeof r, needed);
  void* local_args[32];
  void** args = local_args;
  if (kernel->num_params > 32) args = static_cast<void**>(malloc(kernel->num_params * sizeof(void*)));
  int status = 2;
  if (args == nullptr) {
    snprintf(error, error_len, "out of memory for the arguments of %s", kernel->name);
  } else {
    size_t offset = 0;
    for (int i = 0; i < kernel->num_params; ++i) {
      args[i] = values + offset;
      offset += (kernel->param_sizes[i] + 15) / 16 * 16;
    }
    Launch L{};
    L.kernel = kernel;
    L.args = args;
    L.grid = dim3(gx, gy, gz);
    L.block = dim3(bx, by, bz);
    L.shared_bytes = r.shared_mem;
    L.num_blocks = 1ull * gx * gy * gz;
    L.threads_per_block = static_cast<unsigned>(threads);
    L.schedule = static_cast<Schedule>(r.schedule);
    L.strict = r.strict != 0;
    L.error = error;
    L.error_len = error_len;
    status = launch(&L, r.workers);
  }
  if (args != local_args) free(args);
  if (values != local) free(values);
  return status;
}
