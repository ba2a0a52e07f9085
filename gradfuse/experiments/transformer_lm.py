"""``transformer_lm``: a byte-level causal Transformer language model on Python's own sources.

Corpus: the ``*.py`` files of the standard library of the Python that runs the worker
(``sysconfig.get_paths()["stdlib"]``), read as bytes; nothing is downloaded. Directories
named ``site-packages``, ``dist-packages``, ``test``, ``tests`` and ``idle_test`` are left
out (installed packages and test suites differ from one installation to the next).

Split by file: the sorted relative paths, permuted by ``numpy.random.default_rng(split_seed)``;
the first ``round(val_fraction * files)`` are the validation files, the rest the training
files. Each side is concatenated (sorted by path) and cut into non-overlapping windows of
``seq + 1`` bytes; a window's first ``seq`` bytes are the input, its last ``seq`` the
next-byte targets. Rank r trains on windows ``r::p``; every step takes ``batch_size``
windows of a permutation of its shard. The validation set is ``val_windows`` windows
evenly spaced over the validation stream (all of them if there are fewer).

Net: learned byte embeddings (256 x d_model) plus learned positional embeddings
(seq x d_model), then ``layers`` pre-LayerNorm blocks, ``x = x + attn(LN(x))`` and
``x = x + MLP(LN(x))`` (multi-head causal self-attention with one fused QKV projection
and an output projection; MLP ``d_model -> mlp_ratio * d_model -> d_model`` with GELU),
a final LayerNorm and an **untied** output head Dense(256) with bias (``tie_head=True``
uses the embedding matrix instead, with its own bias). Every projection has a bias. The
defaults (d_model 128, 4 heads, 2 layers, seq 64) have 470 784 trained parameters.
Initialisation: the embeddings N(0, 0.02), the Dense layers Xavier, LayerNorm 1 and 0.

Loss: softmax cross-entropy per byte, averaged over the window (nats per byte). The
runner's epoch is ``steps_per_epoch`` steps (an evaluation interval, far shorter than a
pass over the corpus). Reported: the validation loss (``objective``, nats/byte), bits per
byte (loss / ln 2) and the next-byte accuracy (``test_accuracy``).
"""
import hashlib
import math
import os
import sys
import sysconfig

import numpy as np

from .taskbase import Task, TaskError

VOCAB = 256
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_root():
    """The standard library directory of this Python (``sysconfig.get_paths()["stdlib"]``)."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root=None):
    """The corpus: sorted relative paths of the ``*.py`` files under ``root`` (the stdlib),
    without the directories of ``SKIP_DIRS``.

    Raises:
        TaskError: ``root`` holds no such file.
    """
    root = root or stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        rel = os.path.relpath(d, root)
        out += [os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".py")]
    if not out:
        raise TaskError(f"task 'transformer_lm': no *.py files under the standard library {root!r}")
    return sorted(out)


def split_files(files, split_seed, val_fraction):
    """``(train, val)``: the files permuted by ``default_rng(split_seed)``, the first
    ``round(val_fraction * len(files))`` (at least 1) for validation; each side sorted."""
    order = np.random.default_rng(split_seed).permutation(len(files))
    n_val = min(len(files) - 1, max(1, int(round(val_fraction * len(files)))))
    val = sorted(files[i] for i in order[:n_val])
    train = sorted(files[i] for i in order[n_val:])
    return train, val


def read_stream(root, files):
    """The bytes of ``files`` (relative to ``root``) concatenated, as a uint8 array."""
    chunks = []
    for f in files:
        with open(os.path.join(root, f), "rb") as fh:
            chunks.append(fh.read())
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def windows(stream, seq):
    """``(inputs, targets)``: ``stream`` cut into non-overlapping windows of ``seq + 1`` bytes."""
    n = len(stream) // (seq + 1)
    w = stream[:n * (seq + 1)].reshape(n, seq + 1)
    return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])


def build_lm(d_model, heads, layers, seq, mlp_ratio, tie_head):
    """The byte-level causal Transformer of the module docstring, as a Gluon HybridBlock.

    Args:
        d_model, heads, layers: width, attention heads (``d_model % heads == 0``), blocks.
        seq: the sequence length (the positional table's rows; inputs are ``(B, seq)``).
        mlp_ratio: the MLP's hidden width over ``d_model``.
        tie_head: the output head reuses the byte embedding matrix.

    Returns:
        a HybridBlock mapping byte ids ``(B, seq)`` to logits ``(B, seq, 256)``.
    """
    import mxnet as mx
    from mxnet import gluon

    hd = d_model // heads

    class Attention(gluon.HybridBlock):
        def __init__(self, **kw):
            super().__init__(**kw)
            with self.name_scope():
                self.qkv = gluon.nn.Dense(3 * d_model, flatten=False, in_units=d_model)
                self.proj = gluon.nn.Dense(d_model, flatten=False, in_units=d_model)

        def hybrid_forward(self, F, x):
            # (B, T, 3d) -> (3, B, H, T, hd): the fused projection's rows are q, k, v, head-major
            qkv = self.qkv(x).reshape((0, seq, 3, heads, hd)).transpose((2, 0, 3, 1, 4))
            q, k, v = F.split(qkv, num_outputs=3, axis=0, squeeze_axis=True)
            q, k, v = (t.reshape((-1, seq, hd)) for t in (q, k, v))          # (B*H, T, hd)
            att = F.batch_dot(q, k, transpose_b=True) * (1.0 / math.sqrt(hd))
            pos = F.arange(seq)
            future = F.broadcast_greater(pos.reshape((1, seq)), pos.reshape((seq, 1)))  # [i, j]: j > i
            att = F.broadcast_add(att, (future * -1e9).expand_dims(0))
            y = F.batch_dot(F.softmax(att, axis=-1), v)                     # (B*H, T, hd)
            y = y.reshape((-1, heads, seq, hd)).transpose((0, 2, 1, 3)).reshape((0, 0, -1))
            return self.proj(y)

    class Block(gluon.HybridBlock):
        def __init__(self, **kw):
            super().__init__(**kw)
            with self.name_scope():
                self.ln1 = gluon.nn.LayerNorm(in_channels=d_model)
                self.attn = Attention()
                self.ln2 = gluon.nn.LayerNorm(in_channels=d_model)
                self.fc1 = gluon.nn.Dense(mlp_ratio * d_model, flatten=False, in_units=d_model)
                self.act = gluon.nn.GELU()
                self.fc2 = gluon.nn.Dense(d_model, flatten=False, in_units=mlp_ratio * d_model)

        def hybrid_forward(self, F, x):
            x = x + self.attn(self.ln1(x))
            return x + self.fc2(self.act(self.fc1(self.ln2(x))))

    class ByteLM(gluon.HybridBlock):
        def __init__(self, **kw):
            super().__init__(**kw)
            with self.name_scope():
                self.embed_weight = self.params.get("embed_weight", shape=(VOCAB, d_model),
                                                    init=mx.init.Normal(0.02))
                self.pos_weight = self.params.get("pos_weight", shape=(seq, d_model), init=mx.init.Normal(0.02))
                self.blocks = gluon.nn.HybridSequential()
                for _ in range(layers):
                    self.blocks.add(Block())
                self.ln_f = gluon.nn.LayerNorm(in_channels=d_model)
                if tie_head:
                    self.head_bias = self.params.get("head_bias", shape=(VOCAB,), init=mx.init.Zero())
                else:
                    self.head = gluon.nn.Dense(VOCAB, flatten=False, in_units=d_model)

        def hybrid_forward(self, F, x, embed_weight, pos_weight, head_bias=None):
            h = F.Embedding(x, embed_weight, input_dim=VOCAB, output_dim=d_model)
            h = F.broadcast_add(h, pos_weight.expand_dims(0))
            h = self.ln_f(self.blocks(h))
            if tie_head:
                return F.FullyConnected(h, embed_weight, head_bias, num_hidden=VOCAB, flatten=False)
            return self.head(h)

    return ByteLM()


class TransformerLM(Task):
    """A byte-level causal Transformer LM on the standard library's sources (module docstring).

    Options: ``d_model`` (128), ``heads`` (4), ``layers`` (2), ``seq`` (64), ``mlp_ratio``
    (4), ``tie_head`` (False), ``steps_per_epoch`` (100: the evaluation interval),
    ``val_fraction`` (0.1 of the files), ``val_windows`` (512).

    Example:
        >>> task = TransformerLM(d_model=64, layers=1, steps_per_epoch=50)
        >>> train, val = split_files(stdlib_files(), 0, task.options["val_fraction"])
    """

    name = "transformer_lm"
    model = "transformer-lm-stdlib"
    kind = "language_model"
    num_classes = VOCAB
    cacheable = True
    gap_metric = "objective"
    OPTIONS = {"d_model": 128, "heads": 4, "layers": 2, "seq": 64, "mlp_ratio": 4, "tie_head": False,
               "steps_per_epoch": 100, "val_fraction": 0.1, "val_windows": 512}
    DATA_OPTIONS = ("seq", "val_fraction", "val_windows")

    def validate(self):
        o = self.options
        if o["d_model"] % o["heads"]:
            raise TaskError(f"task 'transformer_lm': d_model = {o['d_model']} is not a multiple of "
                            f"heads = {o['heads']}")
        if not 0 < o["val_fraction"] < 1:
            raise TaskError(f"task 'transformer_lm': option 'val_fraction' must be in (0, 1), "
                            f"got {o['val_fraction']!r}")

    # --- data ------------------------------------------------------------------------
    def data_options(self):
        return {k: self.options[k] for k in self.DATA_OPTIONS}

    def cache_extra(self):
        """The corpus' identity: the stdlib path, the Python version, every file's path and size."""
        root = stdlib_root()
        h = hashlib.sha1()
        for f in stdlib_files(root):
            h.update(f"{f}\0{os.path.getsize(os.path.join(root, f))}\n".encode())
        return {"stdlib": root, "python": sys.version.split()[0], "files": h.hexdigest()}

    def arrays(self, split_seed):
        root = stdlib_root()
        train, val = split_files(stdlib_files(root), split_seed, self.options["val_fraction"])
        seq = self.options["seq"]
        x, y = windows(read_stream(root, train), seq)
        xt, yt = windows(read_stream(root, val), seq)
        n = self.options["val_windows"]
        if len(xt) > n:
            keep = np.unique(np.linspace(0, len(xt) - 1, n).round().astype(np.int64))
            xt, yt = xt[keep], yt[keep]
        return x, y, xt, yt

    def data_info(self, split_seed):
        root = stdlib_root()
        train, val = split_files(stdlib_files(root), split_seed, self.options["val_fraction"])
        size = lambda fs: sum(os.path.getsize(os.path.join(root, f)) for f in fs)  # noqa: E731
        return {"corpus": root, "python": sys.version.split()[0], "train_files": len(train),
                "val_files": len(val), "train_bytes": size(train), "val_bytes": size(val)}

    def steps_per_epoch(self, data, size, batch_size):
        return self.options["steps_per_epoch"]

    def batches(self, rng, data, steps, batch_size):
        """Yield ``steps`` batches of ``batch_size`` windows, from permutations of this rank's
        shard (a new one whenever the current one runs out)."""
        shard = data["shard"]
        if len(shard) < batch_size:
            raise RuntimeError(f"task 'transformer_lm': this rank's shard has {len(shard)} windows, fewer than "
                               f"one batch of {batch_size}")
        perm, pos = rng.permutation(shard), 0
        for _ in range(steps):
            if pos + batch_size > len(perm):
                perm, pos = rng.permutation(shard), 0
            yield perm[pos:pos + batch_size]
            pos += batch_size

    def batch(self, data, idx):
        import mxnet as mx
        return (mx.nd.array(data["x"][idx], dtype="float32"), mx.nd.array(data["y"][idx], dtype="float32"))

    # --- model -----------------------------------------------------------------------
    def build_net(self):
        o = self.options
        return build_lm(o["d_model"], o["heads"], o["layers"], o["seq"], o["mlp_ratio"], o["tie_head"])

    def input_shape(self, data):
        return (1, self.options["seq"])

    def loss(self):
        from mxnet import gluon
        return gluon.loss.SoftmaxCrossEntropyLoss(axis=-1)      # per window: the mean over its bytes

    def evaluate(self, net, data, chunk=128):
        """Validation loss (nats/byte, ``objective``), bits per byte and next-byte accuracy."""
        import mxnet as mx
        xt, yt = data["x_test"], data["y_test"]
        nll, correct = 0.0, 0
        for i in range(0, len(xt), chunk):
            out = net(mx.nd.array(xt[i:i + chunk], dtype="float32"))
            label = mx.nd.array(yt[i:i + chunk], dtype="float32")
            logp = mx.nd.log_softmax(out, axis=-1)
            nll -= float(mx.nd.pick(logp, label, axis=-1).astype("float64").sum().asscalar())
            correct += int((mx.nd.argmax(out, axis=-1) == label).sum().asscalar())
        n = yt.size
        loss = nll / n
        return {"test_accuracy": correct / n, "objective": loss, "bits_per_byte": loss / math.log(2)}

    def diverged_metrics(self):
        """Chance: the uniform predictor's loss, ln 256 nats = 8 bits per byte, accuracy 1/256."""
        return {"test_accuracy": 1.0 / VOCAB, "objective": math.log(VOCAB), "bits_per_byte": 8.0}

    def progress_text(self, metrics):
        return (f"val {metrics.get('objective', float('nan')):.4f} nats/B, "
                f"{metrics.get('bits_per_byte', float('nan')):.3f} bpb")
