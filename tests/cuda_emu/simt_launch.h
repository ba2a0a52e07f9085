// Appended after the kernels and the generated registry (see fakecupy.py).
dim3 threadIdx, blockIdx, gridDim, blockDim;
enum { EMU_MAX_THREADS = 1024, EMU_STACK = 128 * 1024 };
EmuLane emu_lanes[EMU_MAX_THREADS];
int emu_cur;
static char* emu_stack[EMU_MAX_THREADS];    // allocated on first use, kept
static emu_entry emu_fn;
static void** emu_args;

#if defined(__x86_64__)
// Fibers by a bare stack switch: swapcontext saves and restores the signal mask with a
// system call on every switch, which was half the emulator's time (the kernel tests'
// fibers switch at every warp intrinsic). emu_switch saves the callee-saved registers
// on the current stack, stores the stack pointer in *from and continues on `to`'s.
extern "C" void emu_switch(void** from, void* to);
asm(".text\n"
    ".p2align 4\n"
    ".hidden emu_switch\n"
    ".globl emu_switch\n"
    ".type emu_switch,@function\n"
    "emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size emu_switch, .-emu_switch\n");
static void* emu_sched_sp;
static void* emu_sp[EMU_MAX_THREADS];

static void emu_to_sched() { emu_switch(&emu_sp[emu_cur], emu_sched_sp); }
static void emu_to_lane(int t) { emu_switch(&emu_sched_sp, emu_sp[t]); }

[[noreturn]] static void emu_fiber_start()
{
    emu_fn(emu_args);
    emu_lanes[emu_cur].state = 2;
    emu_to_sched();             // never resumed
    std::abort();
}

// a fresh fiber on stack t: its first switch "returns" into emu_fiber_start with the
// stack aligned as at a call (the six callee-saved registers below the entry address)
static void emu_start_lane(unsigned t)
{
    uintptr_t top = (reinterpret_cast<uintptr_t>(emu_stack[t]) + EMU_STACK) & ~uintptr_t(15);
    void** s = reinterpret_cast<void**>(top - 16);
    s[1] = 0;                                   // a null return address above the entry
    s[0] = reinterpret_cast<void*>(&emu_fiber_start);
    for (int r = 1; r <= 6; r++) s[-r] = 0;     // rbp rbx r12 r13 r14 r15
    emu_sp[t] = s - 6;
}
#else
static ucontext_t emu_sched, emu_ctx[EMU_MAX_THREADS];

static void emu_to_sched() { swapcontext(&emu_ctx[emu_cur], &emu_sched); }
static void emu_to_lane(int t) { swapcontext(&emu_sched, &emu_ctx[t]); }

static void emu_lane_main()
{
    emu_fn(emu_args);
    emu_lanes[emu_cur].state = 2;
}   // returns to uc_link = emu_sched

static void emu_start_lane(unsigned t)
{
    getcontext(&emu_ctx[t]);
    emu_ctx[t].uc_stack.ss_sp = emu_stack[t];
    emu_ctx[t].uc_stack.ss_size = EMU_STACK;
    emu_ctx[t].uc_link = &emu_sched;
    makecontext(&emu_ctx[t], emu_lane_main, 0);
}
#endif

void emu_wait(int op, int arg, uint64_t val)
{
    EmuLane& L = emu_lanes[emu_cur];
    L.state = 1; L.op = op; L.arg = arg; L.val = val;
    emu_to_sched();
}

static const char* emu_opname(int op)
{
    return op == EMU_SHFL_DOWN ? "__shfl_down_sync" : op == EMU_SHFL ? "__shfl_sync"
         : op == EMU_BALLOT ? "__ballot_sync" : op == EMU_SYNCWARP ? "__syncwarp" : "__syncthreads";
}

// Run the runnable lanes of warp w until none is runnable; resolve its warp intrinsics
// as long as all 32 lanes meet at one. Returns when every lane returned or waits at a
// barrier (divergence aborts).
static void emu_run_warp(unsigned w)
{
    EmuLane* lanes = emu_lanes + 32 * w;
    for (;;) {
        for (int l = 0; l < 32; l++) {
            if (lanes[l].state != 0) continue;
            emu_cur = (int)(32 * w) + l;
            threadIdx.x = (unsigned)emu_cur; threadIdx.y = 0; threadIdx.z = 0;
            emu_to_lane(emu_cur);
        }
        int done = 0, atsync = 0, waiting = 0, op = -1, arg = 0;
        for (int l = 0; l < 32; l++) {
            if (lanes[l].state == 2) done++;
            else if (lanes[l].op == EMU_SYNC) atsync++;
            else { if (op < 0) { op = lanes[l].op; arg = lanes[l].arg; } waiting++; }
        }
        if (waiting == 0) return;
        bool same = true;
        for (int l = 0; l < 32; l++)
            if (lanes[l].state == 1 && lanes[l].op != EMU_SYNC &&
                (lanes[l].op != op || (op == EMU_SHFL_DOWN && lanes[l].arg != arg)))
                same = false;
        if (done || atsync || !same) {
            std::fprintf(stderr, "simt emulator: warp divergence at %s (block %u,%u, warp base %u): %d lanes "
                         "returned, %d at __syncthreads, %d wait, same intrinsic: %d\n", emu_opname(op),
                         blockIdx.x, blockIdx.y, 32 * w, done, atsync, waiting, (int)same);
            std::abort();
        }
        unsigned ballot = 0;
        for (int l = 0; l < 32; l++) ballot |= (unsigned)(lanes[l].val & 1u) << l;
        for (int l = 0; l < 32; l++) {
            EmuLane& L = lanes[l];
            if (L.op == EMU_SHFL_DOWN) L.res = l + L.arg < 32 ? lanes[l + L.arg].val : L.val;
            else if (L.op == EMU_SHFL) L.res = lanes[L.arg & 31].val;
            else L.res = ballot;
            L.state = 0;
        }
    }
}

// One block: all its threads are fibers; the warps run one after the other between
// barriers (a kernel without __syncthreads runs warp 0 to its end, then warp 1, ...).
static void emu_run_block(unsigned nthreads)
{
    for (unsigned t = 0; t < nthreads; t++) {
        if (!emu_stack[t]) emu_stack[t] = static_cast<char*>(std::malloc(EMU_STACK));
        emu_start_lane(t);
        emu_lanes[t].state = 0;
    }
    for (;;) {
        for (unsigned w = 0; w < nthreads / 32; w++) emu_run_warp(w);
        unsigned done = 0;
        for (unsigned t = 0; t < nthreads; t++) done += emu_lanes[t].state == 2;
        if (done == nthreads) return;
        if (done) {
            std::fprintf(stderr, "simt emulator: __syncthreads not reached by every thread (block %u,%u): "
                         "%u of %u threads returned\n", blockIdx.x, blockIdx.y, done, nthreads);
            std::abort();
        }
        for (unsigned t = 0; t < nthreads; t++) emu_lanes[t].state = 0;   // all at the barrier
    }
}

extern "C" const char* emu_signature(const char* name)
{
    for (const EmuKernel* k = emu_kernels; k->name; k++)
        if (!std::strcmp(k->name, name)) return k->sig;
    return 0;
}

extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned bx, void** args)
{
    emu_entry fn = 0;
    for (const EmuKernel* k = emu_kernels; k->name; k++)
        if (!std::strcmp(k->name, name)) fn = k->fn;
    if (!fn || bx % 32 || bx == 0 || bx > EMU_MAX_THREADS) return -1;
    gridDim.x = gx; gridDim.y = gy; gridDim.z = 1;
    blockDim.x = bx; blockDim.y = 1; blockDim.z = 1;
    emu_fn = fn;
    emu_args = args;
    for (unsigned by = 0; by < gy; by++)
        for (unsigned bxi = 0; bxi < gx; bxi++) {
            blockIdx.x = bxi; blockIdx.y = by; blockIdx.z = 0;
            emu_run_block(bx);
        }
    return 0;
}
