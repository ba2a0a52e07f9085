"""A numpy reference of compressed data-parallel SGD on the digits CNN, outside gradfuse's
exchange: separates a gradfuse bug from the algorithm (docs/experiments.md, "Training
fidelity (issue 14)"). Not collected by pytest; run it by hand:

    python tests/ref_digits_dgc.py --method 1bit --velocity local --seed 0 --stats 3

Only the data split and the net come from gradfuse (``gradfuse.experiments.tasks``); the
P simulated ranks (default 2) run in one process, each on its shard (``rank::P``, batches
of 32 from its own permutation, as the experiment worker draws them), and the
compression is written out here in numpy:

* momentum correction (``--mc 1``, DGC): rank r keeps ``u_r = m u_r + g_r``; error
  feedback ``c = u_r + e_r; e_r = c - Q(c)``; ``w -= lr * mean_r Q(c_r)``.
  ``--mc 0``: error feedback on the raw gradient, momentum after the exchange (GRACE).
* the velocity after a step (``--velocity``): ``local`` (DGC: untouched), ``sent``
  (``u_r = Q(c_r)``, gradfuse's 1-bit default, 1-bit Adam's rule) or ``avg``
  (``u_r = mean_r Q(c_r)``, DeepSpeed's synchronised momentum).
* ``--mask 1``: DGC's momentum factor masking for topk/randomk (``u_j = 0`` where sent).
* ``--clip T``: DGC's local gradient clipping (each rank's gradient norm to T / sqrt(P)).
* Q: ``1bit`` (sign times mean |c| per block of ``--block``, blocks per tensor), ``topk``
  and ``randomk`` (k_i = ceil(ratio n_i) per tensor; random-k's positions shared by all
  ranks), ``none`` (plain momentum SGD on the mean gradient).

Prints one JSON line: the arguments, the final test accuracy and one per epoch; with
``--stats N``, every N epochs the loss, accuracy and per-tensor norms of w, rank 0's
velocity and residual.
"""
import argparse
import json

import numpy as np


def main():
    import mxnet as mx
    from mxnet import autograd

    from gradfuse.experiments.tasks import DigitsCNN

    p = argparse.ArgumentParser()
    p.add_argument("--method", default="none", choices=["none", "1bit", "topk", "randomk"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--m", type=float, default=0.9)
    p.add_argument("--mc", type=int, default=1)
    p.add_argument("--velocity", default="local", choices=["local", "sent", "avg"])
    p.add_argument("--mask", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--stats", type=int, default=0)
    a = p.parse_args()

    task, P = DigitsCNN(), a.ranks
    datas = [task.load(0, r, P) for r in range(P)]
    mx.random.seed(a.seed)
    np.random.seed(a.seed)
    net = task.build_net()
    net.initialize(task.initializer())
    net.hybridize()
    net(mx.nd.zeros((1, 1, 8, 8)))
    params = list(net.collect_params().values())
    shapes = [q.shape for q in params]
    sizes = [int(np.prod(s)) for s in shapes]
    off = np.cumsum([0] + sizes)
    n = int(off[-1])
    loss_fn = task.loss()
    steps = task.steps_per_epoch(datas[0], P, 32)
    rngs = [np.random.default_rng(a.seed + 1 + 7919 * r) for r in range(P)]
    pos_rng = np.random.default_rng(12345)
    u = np.zeros((P, n), np.float32)
    e = np.zeros((P, n), np.float32)
    vel = np.zeros(n, np.float32)
    w = np.concatenate([q.data().asnumpy().reshape(-1) for q in params])

    def grad(r, idx):
        d = datas[r]
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(d["x"][idx])), mx.nd.array(d["y"][idx]))
        loss.backward()
        g = np.concatenate([q.grad().asnumpy().reshape(-1) for q in params]) / len(idx)
        return g.astype(np.float32), float(loss.mean().asscalar())

    def onebit(c):
        out = np.empty_like(c)
        for i in range(len(sizes)):
            for b in range(off[i], off[i + 1], a.block):
                blk = c[b:min(b + a.block, off[i + 1])]
                s = np.abs(blk).mean()
                out[b:b + blk.size] = np.where(blk >= 0, s, -s)
        return out

    def ks(i):
        return max(1, int(np.ceil(a.ratio * sizes[i])))

    def topk(c):
        out = np.zeros_like(c)
        for i in range(len(sizes)):
            t = c[off[i]:off[i + 1]]
            j = np.argpartition(-np.abs(t), ks(i) - 1)[:ks(i)]
            out[off[i] + j] = t[j]
        return out

    hist = []
    for ep in range(1, a.epochs + 1):
        perms = [rngs[r].permutation(datas[r]["shard"]) for r in range(P)]
        total = 0.0
        for s in range(steps):
            gs = []
            for r in range(P):
                g, loss = grad(r, perms[r][s * 32:(s + 1) * 32])
                gs.append(g)
                total += loss
            if a.method == "none":
                vel = a.m * vel + np.mean(gs, 0)
                upd = vel
            else:
                if a.method == "randomk":
                    picked = np.concatenate([off[i] + pos_rng.choice(sizes[i], ks(i), replace=False)
                                             for i in range(len(sizes))])
                sent = []
                for r in range(P):
                    g = gs[r]
                    if a.clip:
                        norm, thr = np.linalg.norm(g), a.clip / np.sqrt(P)
                        if norm > thr:
                            g = g * (thr / norm)
                    u[r] = (a.m * u[r] + g) if a.mc else g
                    c = u[r] + e[r]
                    if a.method == "1bit":
                        q = onebit(c)
                    elif a.method == "topk":
                        q = topk(c)
                    else:
                        q = np.zeros_like(c)
                        q[picked] = c[picked]
                    e[r] = c - q
                    if a.mc and a.mask and a.method != "1bit":
                        u[r][q != 0] = 0
                    if a.mc and a.velocity == "sent":
                        u[r] = q
                    sent.append(q)
                upd = np.mean(sent, 0)
                if a.mc and a.velocity == "avg":
                    u[:] = upd
                if not a.mc:
                    vel = a.m * vel + upd
                    upd = vel
            w -= a.lr * upd
            for i, q in enumerate(params):
                q.set_data(mx.nd.array(w[off[i]:off[i + 1]].reshape(shapes[i])))
        d = datas[0]
        out = net(mx.nd.array(d["x_test"])).asnumpy()
        acc = float((out.argmax(1) == d["y_test"]).mean()) if np.isfinite(out).all() else float("nan")
        hist.append(acc)
        if a.stats and ep % a.stats == 0:
            per = " ".join(f"{params[i].name}: |w| {np.linalg.norm(w[off[i]:off[i + 1]]):.3g} "
                           f"|u| {np.linalg.norm(u[0][off[i]:off[i + 1]]):.3g} "
                           f"|e| {np.linalg.norm(e[0][off[i]:off[i + 1]]):.3g}" for i in range(len(sizes)))
            print(f"epoch {ep} loss {total / steps / P:.4f} acc {acc:.3f} {per}", flush=True)
    print(json.dumps({"args": vars(a), "final": hist[-1], "accuracy": hist}))


if __name__ == "__main__":
    main()
