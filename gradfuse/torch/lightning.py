"""PyTorch Lightning: a ``DDPStrategy`` that registers gradfuse's comm hook on CPU too.

Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only when the root device is
CUDA; on CPU (gloo) the hook is silently ignored. ``GradfuseDDPStrategy`` registers
gradfuse's hook on any device, making the ``CompressionState`` once the process group
exists (the strategy itself is made before it does)::

    strategy = GradfuseDDPStrategy("1bit", momentum=0.9, process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy)
    ...
    strategy.gradfuse_state.stats        # the hook's counters, on every rank

With ``momentum`` the LightningModule's optimizer must run with momentum 0; the strategy
warns once (``CompressionState.check_optimizer``) when it does not. With ``adam``
(``gradfuse_options={"adam": {...}}``) it must be SGD with momentum 0, and a precision
plugin's GradScaler (``precision="16-mixed"``) is refused.
"""
import inspect

from pytorch_lightning.strategies import DDPStrategy

from .hook import CompressionState, comm_hook


class GradfuseDDPStrategy(DDPStrategy):
    """``DDPStrategy`` with gradfuse's DDP comm hook, on CPU and GPU.

    Args:
        compress: the compressor (``CompressionState``'s first argument).
        momentum, start_iter, min_elements, nonfinite, compressor options: passed to
            ``CompressionState`` (``gradfuse_options`` takes any of them as a dict too).
        **kwargs: ``DDPStrategy``'s own arguments (``process_group_backend="gloo"``, ...).
    """

    strategy_name = "ddp_gradfuse"

    def __init__(self, compress="1bit", *, gradfuse_options=None, momentum=0.0, start_iter=0, **kwargs):
        known = set(inspect.signature(DDPStrategy.__init__).parameters)
        opts = dict(gradfuse_options or {})
        for k in [k for k in kwargs if k not in known]:     # compressor options (ratio=, block_size=, ...)
            opts[k] = kwargs.pop(k)
        super().__init__(**kwargs)
        self._gradfuse = dict(opts, compress=compress, momentum=momentum, start_iter=start_iter)
        self.gradfuse_state = None

    def _register_ddp_hooks(self):
        opts = dict(self._gradfuse)
        self.gradfuse_state = CompressionState(opts.pop("compress"), module=self.model.module, **opts)
        self.model.register_comm_hook(self.gradfuse_state, comm_hook)

    def setup(self, trainer):
        """``DDPStrategy.setup``, then a warning if an optimizer keeps its own momentum while
        the hook's state has DGC's (``CompressionState.check_optimizer``)."""
        super().setup(trainer)
        if self.gradfuse_state is not None:
            scaler = getattr(getattr(self, "precision_plugin", None), "scaler", None)   # 16-mixed's GradScaler
            for opt in self.optimizers:
                self.gradfuse_state.check_optimizer(getattr(opt, "_optimizer", opt), scaler)
