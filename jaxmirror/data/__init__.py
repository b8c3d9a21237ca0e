"""The input pipeline: host batches to ``PerReplica`` values (TF's ``input_lib``).

``options`` (InputOptions, InputContext), ``sources`` (what a dataset can be), ``batching``
(TF's split, padding, worker shares), ``placer`` (one ``device_put`` per batch), ``prefetch``
(the background thread), ``datasets``/``from_function``/``iterators`` (what the strategy's
methods return), ``distribute_values`` (``experimental_distribute_values_from_function``).
Named ``data`` rather than ``input`` so that no name of the package shadows the builtin.
"""
