// Appended after the kernels and the generated registry (see fakecupy.py).
dim3 threadIdx, blockIdx, gridDim, blockDim;
enum { EMU_MAX_THREADS = 1024, EMU_STACK = 128 * 1024 };
EmuLane emu_lanes[EMU_MAX_THREADS];
int emu_cur;
static ucontext_t emu_sched, emu_ctx[EMU_MAX_THREADS];
static char* emu_stack[EMU_MAX_THREADS];    // allocated on first use, kept
static emu_entry emu_fn;
static void** emu_args;

void emu_wait(int op, int arg, uint64_t val)
{
    EmuLane& L = emu_lanes[emu_cur];
    L.state = 1; L.op = op; L.arg = arg; L.val = val;
    swapcontext(&emu_ctx[emu_cur], &emu_sched);
}

static void emu_lane_main()
{
    emu_fn(emu_args);
    emu_lanes[emu_cur].state = 2;
}   // returns to uc_link = emu_sched

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
            swapcontext(&emu_sched, &emu_ctx[emu_cur]);
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
        getcontext(&emu_ctx[t]);
        emu_ctx[t].uc_stack.ss_sp = emu_stack[t];
        emu_ctx[t].uc_stack.ss_size = EMU_STACK;
        emu_ctx[t].uc_link = &emu_sched;
        makecontext(&emu_ctx[t], emu_lane_main, 0);
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
