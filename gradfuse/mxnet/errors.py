"""The binding's error types, and the translation of gradfuse's cross-rank errors to them.

Horovod's MXNet ops raise ``mxnet.base.MXNetError``; gradfuse raises ``MismatchError``
(a ``ValueError``) and ``RemoteInputError``. The classes here are both.
"""
from mxnet.base import MXNetError

from ..errors import MismatchError, RemoteInputError


class CollectiveMismatchError(MismatchError, MXNetError):
    """Ranks disagreed on a collective; raised on every rank before any data moved."""


class RemoteInputMXNetError(RemoteInputError, MXNetError):
    """Another rank rejected its own input for this collective."""


def _mxnet_error(exc):
    """gradfuse's cross-rank errors as the MXNetError subclasses of this binding."""
    if isinstance(exc, MXNetError):
        return exc
    if isinstance(exc, RemoteInputError):
        return RemoteInputMXNetError(str(exc))
    return CollectiveMismatchError(str(exc))


def _wait(handle):
    try:
        return handle.wait()
    except (RemoteInputError, MismatchError) as exc:
        raise _mxnet_error(exc) from None


def _as_mxnet_errors(fn, *args, **kw):
    """Run a blocking gradfuse collective, raising cross-rank errors as MXNet errors."""
    try:
        return fn(*args, **kw)
    except (RemoteInputError, MismatchError) as exc:
        raise _mxnet_error(exc) from None
