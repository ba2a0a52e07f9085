"""The cost model of PowerSGD against fp32 ring, 1-bit allgather and two-phase on ResNet-50 (docs/compressors.md, "PowerSGD")."""
import math
from gradfuse.bench.network_worker import WORKLOADS, buckets, bucket_shapes
from gradfuse.compressors import cost
shapes = WORKLOADS["resnet50"]()
counts = [math.prod(s) for s in shapes]
P = (2, 4, 8, 16, 32, 64, 128, 256)
rows = [("none", "ring", {}), ("1bit", "allgather", {}), ("1bit", "twophase", {}),
        ("powersgd", "powersgd", {"rank": 1}), ("powersgd", "powersgd", {"rank": 4})]
for (thr, label), link in [(t, cost.link_from(l, 50e-6)) for l in ("1gbit", "100mbit") for t in ((1 << 20, "1 MiB buckets"), (1 << 40, "one bucket"))]:
    bs, shs = buckets(counts, thr), bucket_shapes(shapes, thr)
    def step(c, a, o, p):
        return sum(cost.predict(c, a, n, p, link, options=o, counts=None if c != "1bit" else None, shapes=s)
                   for n, s in zip(bs, shs))
    print(f"\n{label} ({len(bs)}), {link}")
    print("| method | " + " | ".join(f"p={p}" for p in P) + " |")
    print("|---|" + "---:|" * len(P))
    for c, a, o in rows:
        print(f"| {c} {a} {o.get('rank', '')} | " + " | ".join(f"{step(c, a, o, p) * 1e3:.0f}" for p in P) + " |")
    # who wins at each p
    print("| fastest | " + " | ".join(min(rows, key=lambda r: step(r[0], r[1], r[2], p))[0] + " " +
                                       min(rows, key=lambda r: step(r[0], r[1], r[2], p))[1] for p in P) + " |")
    for c, a, o in rows[1:]:
        lose = next((p for p in range(2, 257) if step(c, a, o, p) >= step("none", "ring", {}, p)), None)
        print(f"  {c} {a} {o.get('rank', '')}: slower than the fp32 ring from p = {lose if lose else '> 256'}")
