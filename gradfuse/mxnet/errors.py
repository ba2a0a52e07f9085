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


class InvalidInputMXNetError(ValueError, MXNetError):
    """This rank's own input was refused (a ValueError, and the MXNetError Horovod raises)."""


class InvalidTypeMXNetError(TypeError, MXNetError):
    """This rank's own input has a type or dtype it cannot take (a TypeError and an MXNetError)."""


def _local_mxnet_error(exc):
    """This rank's own TypeError/ValueError as one that is also an MXNetError, same message."""
    cls = InvalidTypeMXNetError if isinstance(exc, TypeError) else InvalidInputMXNetError
    return cls(str(exc)).with_traceback(exc.__traceback__)


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
    except (TypeError, ValueError) as exc:      # this rank's own input (the others: RemoteInput...)
        if isinstance(exc, MXNetError):
            raise
        raise _local_mxnet_error(exc) from None


def _as_mxnet_errors(fn, *args, **kw):
    """Run a blocking gradfuse collective, raising cross-rank errors as MXNet errors."""
    try:
        return fn(*args, **kw)
    except (RemoteInputError, MismatchError) as exc:
        raise _mxnet_error(exc) from None
