"""Exceptions raised by gradfuse.

Cross-rank errors are raised identically on every rank, before any data moves.
"""


class GradfuseError(RuntimeError):
    """Base class for gradfuse's own run-time errors."""


class MismatchError(ValueError):
    """The ranks disagreed on a collective (names, order, shapes, dtypes or options).

    Raised on every rank with the same message, which names the tensor, the ranks and
    both values, before any data is reduced.
    """


class RemoteInputError(ValueError):
    """Another rank rejected its own input for this collective, so this rank stops too."""


class StallError(GradfuseError):
    """A rank did not arrive at a collective within GRADFUSE_STALL_TIMEOUT_S."""


class NonFiniteError(GradfuseError, FloatingPointError):
    """A compressed step saw NaN or Inf (in an input, or from fp16 overflow).

    Raised on every rank before any result is written; error-feedback residuals are left
    as they were before the step.
    """
