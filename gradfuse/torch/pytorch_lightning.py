"""PyTorch Lightning (the older ``pytorch_lightning`` package): gradfuse's DDP strategy.

``GradfuseDDPStrategy`` is Lightning's ``DDPStrategy`` with gradfuse's comm hook on CPU
and GPU, and the hook state saved in and restored from Lightning's checkpoints
(``gradfuse.torch.strategy``)::

    import pytorch_lightning as pl
    from gradfuse.torch.pytorch_lightning import GradfuseDDPStrategy
    strategy = GradfuseDDPStrategy("1bit", momentum=0.9, process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy)
    trainer.fit(model, loader)                       # or ckpt_path=...: resumes bit-exactly
    strategy.gradfuse_state.stats                    # the hook's counters, on every rank

With ``momentum`` the LightningModule's optimizer must run with momentum 0; the strategy
warns once (``CompressionState.check_optimizer``) when it does not. The current
``lightning`` package's ``Trainer`` refuses this class: use
``gradfuse.torch.lightning.GradfuseDDPStrategy`` there.
"""
from pytorch_lightning.strategies import DDPStrategy

from .strategy import GradfuseStrategyMixin


class GradfuseDDPStrategy(GradfuseStrategyMixin, DDPStrategy):
    """``pytorch_lightning``'s ``DDPStrategy`` with gradfuse's DDP comm hook, on CPU and GPU.

    Args:
        compress: the compressor (``CompressionState``'s first argument).
        momentum, start_iter, min_elements, nonfinite, compressor options: passed to
            ``CompressionState`` (``gradfuse_options`` takes any of them as a dict too).
        **kwargs: ``DDPStrategy``'s own arguments (``process_group_backend="gloo"``, ...).

    Example:
        >>> trainer = pl.Trainer(accelerator="gpu", devices=8, strategy=GradfuseDDPStrategy("1bit", momentum=0.9))
    """

    _ddp_base = DDPStrategy
