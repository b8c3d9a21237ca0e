"""``StepExchange``: workers tell each other small per-step facts through the coordinator.

A distributed dataset's workers may read different data (``distribute_datasets_from_function``,
or different files given to ``experimental_distribute_dataset``), so every step they agree on
how many rows each replica got and whether the epoch goes on; otherwise a partial last step, or
one worker running out first, leaves the others waiting in a collective for ever, or pairs one
worker's step with another's evaluation. The facts go through ``jax.distributed``'s key-value
store (its coordination service), not through XLA collectives: a collective issued by a
prefetch thread could interleave with the training step's in a different order on each worker.
The waits are the ledger's (``runtime/ledger.py``): a failed, dead or finished worker, or
``CommunicationOptions(timeout_seconds)``, ends them with an error naming it, raised to whoever
takes the batch (an iterator nobody reads any more fails nobody).
"""

from __future__ import annotations

import itertools
import json

from jaxmirror.core import _compat
from jaxmirror.runtime import failures, ledger

_names = itertools.count()


class StepExchange:
    """Per-step all-gather of a small JSON value among this cluster's workers.

    Every worker makes its exchanges in the same order (a new pass over a dataset is agreed
    in the ledger first), so the n-th ``StepExchange`` made on each worker pairs up with the
    others' n-th.

    Args:
        what: a label for the key names and messages.
        cancelled: a function returning True once the exchange is no longer wanted (its
            iterator was closed): a ``share`` waiting then returns ``None``.

    Example:
        >>> ex = StepExchange("doc")   # one process: the exchange is with itself
        >>> ex.share([3, 1])
        [[3, 1]]
    """

    def __init__(self, what: str, cancelled=None):
        self._what = what
        self._prefix = f"jaxmirror/exchange/{next(_names)}"
        self._round = 0
        self._cancelled = cancelled or (lambda: False)

    def share(self, value):
        """Give this worker's ``value``; get every worker's, in worker order.

        Args:
            value: a JSON-serializable value.

        Returns:
            A list with one value per worker (process order), or ``None`` once cancelled.

        Raises:
            errors.UnavailableError, errors.CollectiveMismatchError,
            errors.DeadlineExceededError: as ``ledger.agree``.
        """
        layout = failures.joined()
        if layout is None:
            return [value]
        client = _compat.distributed_client()
        step = f"{self._prefix}/{self._round}"
        self._round += 1
        me = layout.process_id
        _compat.kv_set(client, f"{step}/{me}", json.dumps(value))
        values = []
        for worker in range(layout.num_processes):
            if worker == me:
                values.append(value)
                continue
            # An error here goes to whoever takes the batch (the prefetch thread hands it on).
            text = ledger.wait_for_peer(client, f"{step}/{worker}", layout, worker,
                                        f"next() on a DistributedDataset from {self._what}",
                                        cancelled=self._cancelled, record=False)
            if text is None:
                return None
            values.append(json.loads(text))
        if self._round > 2:  # everyone has read the round before last: drop this worker's key
            _compat.kv_delete(client, f"{self._prefix}/{self._round - 3}/{me}")
        return values
