"""The pipeline's counters (``Pipeline.stats``; the bindings sum their pipelines' counters)."""


class Stats:
    """Counters of one pipeline (read them as attributes or with ``as_dict()``).

    ``bytes_reduced`` counts the gradient bytes a step reduced (uncompressed size), so a
    collective that was stopped by the control plane or the non-finite policy adds 0.
    ``bytes_sent`` estimates the bytes this rank put on the wire: a compressed bucket's
    payloads as its collective sends them, an uncompressed allreduce (``none``, warm-up
    steps, non-float32 buckets) as a bandwidth-optimal one's 2(p-1)/p x its size (the MPI
    library or NCCL picks the real algorithm).
    ``cast_overflow``/``cast_underflow`` count fp16/bf16 values that became inf / zero.
    """

    FIELDS = ("steps", "tensors", "buckets", "bytes_reduced", "bytes_sent", "plans_built", "failed_steps",
              "nonfinite_steps", "cast_overflow", "cast_underflow")

    def __init__(self):
        for f in self.FIELDS:
            setattr(self, f, 0)

    def as_dict(self):
        return {f: getattr(self, f) for f in self.FIELDS}

    def __repr__(self):
        return f"Stats({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"
