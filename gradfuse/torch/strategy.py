"""What gradfuse's Lightning strategies share, whichever Lightning package runs them.

Lightning ships as ``lightning`` (``lightning.pytorch``, the current package) and as the
older ``pytorch_lightning``; each package's ``Trainer`` accepts only its own package's
strategies, so gradfuse has one strategy class per package
(``gradfuse.torch.lightning.GradfuseDDPStrategy`` and
``gradfuse.torch.pytorch_lightning.GradfuseDDPStrategy``), both made of this mixin and
that package's ``DDPStrategy``. This module imports neither package.

What the mixin adds to ``DDPStrategy``:

- the hook on any device: Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers a hook
  only when the root device is CUDA (on CPU it is silently ignored); the mixin makes the
  ``CompressionState`` once the process group exists (the strategy is made before it)
  and registers gradfuse's hook on CPU and GPU alike;
- the hook state in Lightning's checkpoints: ``save_checkpoint`` (every rank calls it)
  gathers every rank's ``state_dict()`` (``gradfuse.torch.checkpoint.gather``, over the
  hook's gloo control group) into the checkpoint's ``"gradfuse"`` entry, which rank 0
  writes; ``load_checkpoint`` keeps this rank's entry and restores it into the hook state
  as soon as that exists (Lightning loads a checkpoint before it wraps the model in DDP),
  so ``trainer.fit(model, ckpt_path=...)`` continues bit-exactly;
- a warning (``CompressionState.check_optimizer``) when the hook keeps DGC's momentum and
  an optimizer keeps its own too, or keeps Adam's moments (``gradfuse_options={"adam":
  {...}}``) and an optimizer would apply Adam again; with ``adam`` a precision plugin's
  GradScaler (``precision="16-mixed"``) is refused.
"""
import inspect

from . import checkpoint as _ckpt
from .hook import CompressionState, comm_hook

KEY = "gradfuse"        # the checkpoint entry that holds every rank's hook state


class GradfuseStrategyMixin:
    """The gradfuse part of a Lightning ``DDPStrategy`` (put it first in the bases).

    Args:
        compress: the compressor (``CompressionState``'s first argument).
        gradfuse_options: any of ``CompressionState``'s options, as a dict.
        momentum, start_iter: passed to ``CompressionState``.
        **kwargs: ``DDPStrategy``'s own arguments (``process_group_backend="gloo"``, ...);
            the ones ``DDPStrategy`` does not take are compressor options (``ratio=``,
            ``block_size=``, ...) and go to ``CompressionState``.
    """

    strategy_name = "ddp_gradfuse"
    _ddp_base = None            # the package's DDPStrategy (set by each subclass)

    def __init__(self, compress="1bit", *, gradfuse_options=None, momentum=0.0, start_iter=0, **kwargs):
        known = set(inspect.signature(self._ddp_base.__init__).parameters)
        opts = dict(gradfuse_options or {})
        for k in [k for k in kwargs if k not in known]:     # compressor options (ratio=, block_size=, ...)
            opts[k] = kwargs.pop(k)
        super().__init__(**kwargs)
        self._gradfuse = dict(opts, compress=compress, momentum=momentum, start_iter=start_iter)
        self.gradfuse_state = None
        self._gradfuse_restore = None       # (this rank's saved state, the checkpoint's path)

    def _register_ddp_hooks(self):
        opts = dict(self._gradfuse)
        self.gradfuse_state = CompressionState(opts.pop("compress"), module=self.model.module, **opts)
        self.model.register_comm_hook(self.gradfuse_state, comm_hook)
        self._gradfuse_apply()

    def setup(self, trainer):
        """``DDPStrategy.setup``, then a warning if an optimizer keeps its own momentum while
        the hook's state has DGC's (``CompressionState.check_optimizer``)."""
        super().setup(trainer)
        if self.gradfuse_state is not None:
            scaler = getattr(getattr(self, "precision_plugin", None), "scaler", None)   # 16-mixed's GradScaler
            for opt in self.optimizers:
                self.gradfuse_state.check_optimizer(getattr(opt, "_optimizer", opt), scaler)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        """``DDPStrategy.save_checkpoint`` with every rank's hook state in ``checkpoint["gradfuse"]``.
        Collective: Lightning calls it on every rank; rank 0 writes the file."""
        if self.gradfuse_state is not None:
            state = self.gradfuse_state
            checkpoint[KEY] = _ckpt.gather(state.state_dict(), state.comm.ctl)
        return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, *args, **kwargs):
        """``DDPStrategy.load_checkpoint``; this rank's hook state from it is restored into the
        hook as soon as the hook exists (at once if it does)."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        saved = checkpoint.get(KEY) if isinstance(checkpoint, dict) else None
        if saved is not None:
            self._gradfuse_restore = (saved, str(checkpoint_path))
            if self.gradfuse_state is not None:
                self._gradfuse_apply()
        return checkpoint

    def _gradfuse_apply(self):
        if self._gradfuse_restore is None or self.gradfuse_state is None:
            return
        (saved, path), self._gradfuse_restore = self._gradfuse_restore, None
        state = self.gradfuse_state
        state.load_state_dict(_ckpt.pick(saved, state.comm.rank, state.comm.size, where=path),
                              where=f"the gradfuse hook state in {path!r}")
