"""The default strategy: what is current when no strategy is (``tf.distribute.get_strategy()``).

Importing this module registers it with ``core.context`` (which cannot import it: it is the
bottom layer).
"""

from __future__ import annotations

import contextlib

import jax

from jaxmirror.core import context
from jaxmirror.step.program import check_can_run, wants_arguments
from jaxmirror.step.replica_context import ReplicaContext
from jaxmirror.strategies.extended import StrategyExtended
from jaxmirror.strategies.strategy import Strategy


class _DirectCall:
    """The default strategy's "program": TF's default strategy calls ``fn`` as it is."""

    def __init__(self, strategy, fn):
        self._strategy = strategy
        self._fn = fn
        self.trace_count = self.compile_count = 0
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    @property
    def wants_arguments(self) -> bool:
        return wants_arguments(self._fn)

    def __call__(self, *args, **kwargs):
        check_can_run(self._strategy)
        return self._fn(*args, **kwargs)


class DefaultStrategy(Strategy):
    """One replica on JAX's default device; ``run`` calls the function directly.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.get_strategy()
        >>> s.num_replicas_in_sync, s.run(lambda: 1 + 1)
        (1, 2)
    """

    def __init__(self):
        super().__init__(StrategyExtended(self, [jax.devices()[0]]))

    def _program(self, fn, options):
        return _DirectCall(self, fn)  # nothing compiled, so nothing to cache

    @contextlib.contextmanager
    def scope(self):
        if context.has_strategy():
            raise RuntimeError("Must not nest jaxmirror Strategy scopes.")  # TF's wording
        with context.default_scope():  # no context pushed: TF's default scope pushes none
            yield self


def _make_default() -> tuple:
    strategy = DefaultStrategy()
    # The default replica context: replica 0 of 1, whose collectives return their input.
    return strategy, ReplicaContext(strategy, replica_id_in_sync_group=0)


context.register_default(_make_default)
