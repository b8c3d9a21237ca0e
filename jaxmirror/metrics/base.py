"""``Metric``: the base of every metric, a named set of sync-on-read state variables."""

from __future__ import annotations

import functools
import re

import jax.numpy as jnp

from jaxmirror.core import context
from jaxmirror.metrics.accumulation import zero
from jaxmirror.runtime import ledger
from jaxmirror.variables.variable import Variable


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def checked_dtype(api: str, dtype):
    """A metric's ``dtype`` argument as a floating NumPy dtype (float32 for ``None``).

    Args:
        api: the API name errors start with.
        dtype: ``None``, or anything ``jnp.dtype`` accepts.

    Returns:
        A floating ``numpy.dtype``.

    Raises:
        ValueError: for anything else.
    """
    try:
        resolved = jnp.dtype(jnp.float32 if dtype is None else dtype)
    except TypeError:
        resolved = None
    if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
        raise ValueError(f"{api}: `dtype` must be a floating dtype (float32, bfloat16, ...); "
                         f"got {dtype!r}.")
    return resolved


def _named_result(result):
    """``result`` whose reads are named ``<metric class>.result()`` in the multi-worker ledger
    (``runtime/ledger.py``: a result read on the chief only is named in every worker's error)."""
    @functools.wraps(result)
    def named_result(self, *args, **kwargs):
        if not ledger.active():
            return result(self, *args, **kwargs)
        with ledger.named(f"{type(self).__name__}.result()"):
            return result(self, *args, **kwargs)

    return named_result


class Metric:
    """The base of metrics: state variables a step updates and ``result()`` reads (``tf.keras.metrics.Metric``).

    A metric keeps running totals in variables created with ``add_weight``: sync-on-read
    variables with SUM aggregation (``jaxmirror.Variable(..., synchronization="on_read",
    aggregation="sum", trainable=False)``) of the strategy current when the metric is made.
    Under a ``MirroredStrategy`` each replica adds its own examples to its own component inside
    ``strategy.run``, and reading a variable outside the step sums the components. Created
    outside every strategy's scope, a metric has plain variables (those of the default
    strategy), which steps of a single replica can update. Create metrics before the step
    (not inside ``run``), and use them in it by closure, as in TF.

    A subclass creates its variables in ``__init__`` with ``add_weight`` and defines
    ``update_state`` and ``result``; ``reset_state`` and ``__call__`` come from here. The
    metrics in this package leave the rows padding a distributed batch out of their totals; a
    subclass that adds to its variables itself must do that too (see
    ``jaxmirror.step.replica_context.row_mask``), or build on ``Mean`` or
    ``MeanMetricWrapper``, which do.

    Args:
        name: the metric's name; by default its class's name in snake case.
        dtype: the floating dtype of its state and result (float32 by default).

    Raises:
        ValueError: for a ``dtype`` that is not floating or a ``name`` that is not a string.

    Example:
        >>> import jax.numpy as jnp, jaxmirror
        >>> from jaxmirror import metrics
        >>> class Positives(metrics.Metric):
        ...     def __init__(self, name="positives", dtype=None):
        ...         super().__init__(name=name, dtype=dtype)
        ...         self.positives = self.add_weight("positives")
        ...     def update_state(self, values):
        ...         self.positives.assign_add(jnp.sum(values > 0).astype(self.dtype))
        ...     def result(self):
        ...         return self.positives.read_value()
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     positives = Positives()
        >>> x = s.experimental_distribute_values_from_function(
        ...     lambda ctx: jnp.array([1.0, -1.0, 2.0]) * (ctx.replica_id_in_sync_group + 1))
        >>> s.run(lambda x: positives.update_state(x), args=(x,))
        >>> float(positives.result()), [float(c) for c in positives.positives.values]
        (4.0, [2.0, 2.0])
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "result" in cls.__dict__:  # its reads agree across workers as this metric's result()
            cls.result = _named_result(cls.__dict__["result"])

    def __init__(self, name=None, dtype=None):
        api = type(self).__name__
        if name is None:
            name = _snake_case(api)
        if not isinstance(name, str):
            raise ValueError(f"{api}: `name` must be a string; got {name!r}.")
        self._name = name
        self._dtype = checked_dtype(api, dtype)
        self._variables: list = []

    @property
    def name(self) -> str:
        """The metric's name."""
        return self._name

    @property
    def dtype(self):
        """The dtype of the metric's state and result (a floating ``numpy.dtype``)."""
        return self._dtype

    @property
    def variables(self) -> list:
        """The metric's state variables, in the order ``add_weight`` made them."""
        return list(self._variables)

    def add_weight(self, name: str, shape=(), dtype=None):
        """Create a state variable of the metric: zeros, sync-on-read, SUM, not trainable.

        Args:
            name: the variable's name.
            shape: its shape (a scalar by default).
            dtype: its dtype; the metric's by default.

        Returns:
            The new variable: a ``SyncOnReadVariable`` of the current strategy inside a
            ``MirroredStrategy``'s scope, a plain ``Variable`` outside every scope.

        Raises:
            RuntimeError: inside ``run`` (create metrics before the step).

        Example:
            >>> import jaxmirror
            >>> from jaxmirror import metrics
            >>> with jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"]).scope():
            ...     m = metrics.Metric(name="custom")
            ...     v = m.add_weight("hits", shape=(2,))
            >>> type(v).__name__, v.shape, [w.name for w in m.variables]
            ('SyncOnReadVariable', (2,), ['hits'])
        """
        if context.current().in_run:
            raise RuntimeError(
                f"{type(self).__name__}: metric {self._name!r} was created inside `run`; create "
                f"metrics before the step (inside `strategy.scope()`) and use them in it by "
                f"closure."
            )
        variable = Variable(jnp.zeros(shape, dtype or self._dtype), trainable=False,
                            synchronization="on_read", aggregation="sum", name=name)
        self._variables.append(variable)
        return variable

    def update_state(self, *args, **kwargs):
        """Add a batch's examples to the state; subclasses define it.

        Args:
            *args: the batch, as the subclass defines.
            **kwargs: as the subclass defines (``sample_weight``, typically).

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError(f"{type(self).__name__}: a Metric subclass must define "
                                  f"update_state.")

    def result(self):
        """The metric's value from its state; subclasses define it.

        Returns:
            An array of the metric's dtype.

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError(f"{type(self).__name__}: a Metric subclass must define result.")

    def reset_state(self) -> None:
        """Set every component of every state variable to zero (e.g. at the start of an epoch).

        Returns:
            None.

        Example:
            >>> from jaxmirror import metrics
            >>> m = metrics.Sum()
            >>> m.update_state([1.0, 2.0])
            >>> m.reset_state()
            >>> float(m.result())
            0.0
        """
        zero(self._variables)

    def reset_states(self) -> None:
        """``reset_state()`` under the name Keras 2 (and TF's tutorials) used.

        Returns:
            None.

        Example:
            >>> from jaxmirror import metrics
            >>> m = metrics.Mean()
            >>> m.update_state([4.0])
            >>> m.reset_states()
            >>> float(m.result())
            0.0
        """
        self.reset_state()

    def __call__(self, *args, **kwargs):
        """``update_state(*args, **kwargs)``, then ``result()``.

        Args:
            *args: as for ``update_state``.
            **kwargs: as for ``update_state``.

        Returns:
            The result with this batch counted.

        Example:
            >>> from jaxmirror import metrics
            >>> float(metrics.Mean()([1.0, 2.0, 6.0]))
            3.0
        """
        self.update_state(*args, **kwargs)
        return self.result()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self._name!r} dtype={self._dtype}>"
