// Appended after the kernels and the generated registry (see fakecupy.py).
dim3 threadIdx, blockIdx, gridDim, blockDim;
EmuLane emu_lanes[32];
int emu_cur;
static ucontext_t emu_sched, emu_ctx[32];
static char emu_stack[32][128 * 1024];
static emu_entry emu_fn;
static void** emu_args;
static unsigned emu_warp_base;

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
    return op == EMU_SHFL_DOWN ? "__shfl_down_sync" : op == EMU_SHFL ? "__shfl_sync" : "__ballot_sync";
}

static void emu_run_warp()
{
    for (int l = 0; l < 32; l++) {
        getcontext(&emu_ctx[l]);
        emu_ctx[l].uc_stack.ss_sp = emu_stack[l];
        emu_ctx[l].uc_stack.ss_size = sizeof(emu_stack[l]);
        emu_ctx[l].uc_link = &emu_sched;
        makecontext(&emu_ctx[l], emu_lane_main, 0);
        emu_lanes[l].state = 0;
    }
    for (;;) {
        for (int l = 0; l < 32; l++) {
            if (emu_lanes[l].state != 0) continue;
            emu_cur = l;
            threadIdx.x = emu_warp_base + l; threadIdx.y = 0; threadIdx.z = 0;
            swapcontext(&emu_sched, &emu_ctx[l]);
        }
        int done = 0, waiting = 0;
        for (int l = 0; l < 32; l++) { done += emu_lanes[l].state == 2; waiting += emu_lanes[l].state == 1; }
        if (done == 32) return;
        int op = -1, arg = 0;
        for (int l = 0; l < 32; l++) if (emu_lanes[l].state == 1) { op = emu_lanes[l].op; arg = emu_lanes[l].arg; break; }
        bool same = true;
        for (int l = 0; l < 32; l++)
            if (emu_lanes[l].state == 1 && (emu_lanes[l].op != op || (op == EMU_SHFL_DOWN && emu_lanes[l].arg != arg)))
                same = false;
        if (done || !same) {
            std::fprintf(stderr, "simt emulator: warp divergence at %s (block %u,%u, warp base %u): %d lanes "
                         "returned, %d wait, same intrinsic: %d\n", emu_opname(op), blockIdx.x, blockIdx.y,
                         emu_warp_base, done, waiting, (int)same);
            std::abort();
        }
        unsigned ballot = 0;
        for (int l = 0; l < 32; l++) ballot |= (unsigned)(emu_lanes[l].val & 1u) << l;
        for (int l = 0; l < 32; l++) {
            EmuLane& L = emu_lanes[l];
            if (L.op == EMU_SHFL_DOWN) L.res = l + L.arg < 32 ? emu_lanes[l + L.arg].val : L.val;
            else if (L.op == EMU_SHFL) L.res = emu_lanes[L.arg & 31].val;
            else L.res = ballot;
            L.state = 0;
        }
    }
}

extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned bx, void** args)
{
    emu_entry fn = 0;
    for (const EmuKernel* k = emu_kernels; k->name; k++)
        if (!std::strcmp(k->name, name)) fn = k->fn;
    if (!fn || bx % 32) return -1;
    gridDim.x = gx; gridDim.y = gy; gridDim.z = 1;
    blockDim.x = bx; blockDim.y = 1; blockDim.z = 1;
    emu_fn = fn;
    emu_args = args;
    for (unsigned by = 0; by < gy; by++)
        for (unsigned bxi = 0; bxi < gx; bxi++)
            for (unsigned w = 0; w < bx / 32; w++) {
                blockIdx.x = bxi; blockIdx.y = by; blockIdx.z = 0;
                emu_warp_base = w * 32;
                emu_run_warp();
            }
    return 0;
}
