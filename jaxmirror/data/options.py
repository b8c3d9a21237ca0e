"""How a dataset is distributed: ``InputOptions``, ``InputContext``, replication and shard modes."""

from __future__ import annotations

import dataclasses
import enum


class InputReplicationMode(enum.Enum):
    """How ``distribute_datasets_from_function`` builds input pipelines (TF's enum of that name).

    ``PER_WORKER``: ``dataset_fn`` is called once per worker and every replica of the worker
    takes the next element of that one dataset. ``PER_REPLICA``: ``dataset_fn`` is called once
    per replica and each replica reads its own dataset.

    Example:
        >>> import jaxmirror
        >>> jaxmirror.InputReplicationMode.PER_WORKER.value
        'PER_WORKER'
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class AutoShardPolicy(enum.Enum):
    """How ``experimental_distribute_dataset`` shares a dataset among workers (TF's enum).

    * ``AUTO``: ``FILE`` for file-based datasets (``experimental.FileDataset``), otherwise
      ``DATA``; a Python iterable of batches has no files, so it is ``DATA``.
    * ``DATA``: every worker reads every global batch and keeps its own replicas' rows, so each
      example is used once per step across the cluster.
    * ``FILE``: each worker reads its own files of an ``experimental.FileDataset`` (worker
      ``w`` of ``W``: files ``w, w + W, ...``); other datasets are batches, not files, so it
      is refused for them with more than one worker.
    * ``OFF``: no sharding across workers: every worker splits every global batch over its own
      replicas only (each example is used once per worker).

    With one worker every policy is the same.

    Example:
        >>> import jaxmirror
        >>> jaxmirror.experimental.AutoShardPolicy.DATA.name
        'DATA'
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for distributing a dataset (``tf.distribute.InputOptions``, with two JAX extras).

    Args:
        experimental_fetch_to_device: place each batch on the replicas' devices (``None`` means
            True). False leaves batches as host (NumPy) arrays; ``run`` copies them then.
        experimental_replication_mode: an ``InputReplicationMode``; ``PER_REPLICA`` is for
            ``distribute_datasets_from_function`` only.
        experimental_place_dataset_on_device: TF's option for pipelines that run on the device;
            accepted with ``PER_REPLICA`` and no fetching, as TF requires (in JAX the pipeline
            runs on the host either way).
        experimental_per_replica_buffer_size: how many batches wait on the devices ahead of the
            one in use (prefetched on a background thread while the previous step runs).
        drop_remainder: drop global batches smaller than the first one (TF's
            ``batch(..., drop_remainder=True)``) instead of padding them.
        auto_shard_policy: an ``experimental.AutoShardPolicy`` for several workers.
        prefetch_thread: make and place batches on a background thread (True) or in ``next``
            (False). ``None`` (the default) uses the thread unless every device is a CPU: there
            the "device" is host memory, and a thread's copies only compete with XLA's compute
            for the same cores (``benchmarks/RESULTS.md``).

    Raises:
        ValueError: for a bad value or combination, with TF's messages.

    Example:
        >>> import jaxmirror
        >>> options = jaxmirror.InputOptions(experimental_per_replica_buffer_size=2)
        >>> options.experimental_fetch_to_device, options.drop_remainder
        (True, False)
    """

    experimental_fetch_to_device: bool | None = None
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1
    drop_remainder: bool = False
    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO
    prefetch_thread: bool | None = None

    def __post_init__(self):
        fetch = self.experimental_fetch_to_device
        if fetch is None:
            object.__setattr__(self, "experimental_fetch_to_device", True)
        elif not isinstance(fetch, bool):
            raise ValueError(f"InputOptions: `experimental_fetch_to_device` must be a bool or "
                             f"None; got {fetch!r}.")
        mode = self.experimental_replication_mode
        if not isinstance(mode, InputReplicationMode):
            raise ValueError(f"InputOptions: `experimental_replication_mode` must be an "
                             f"InputReplicationMode; got {mode!r}.")
        size = self.experimental_per_replica_buffer_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"InputOptions: `experimental_per_replica_buffer_size` must be an "
                             f"int >= 1; got {size!r}.")
        for name in ("experimental_place_dataset_on_device", "drop_remainder"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"InputOptions: `{name}` must be a bool; got "
                                 f"{getattr(self, name)!r}.")
        if self.prefetch_thread is not None and not isinstance(self.prefetch_thread, bool):
            raise ValueError(f"InputOptions: `prefetch_thread` must be a bool or None; got "
                             f"{self.prefetch_thread!r}.")
        if not isinstance(self.auto_shard_policy, AutoShardPolicy):
            raise ValueError(f"InputOptions: `auto_shard_policy` must be an AutoShardPolicy; got "
                             f"{self.auto_shard_policy!r}.")
        if self.experimental_place_dataset_on_device:
            if mode is InputReplicationMode.PER_WORKER:  # TF's wording, on purpose (3 errors)
                raise ValueError("When `experimental_place_dataset_on_device` is set for dataset "
                                 "placement, you must also specify `PER_REPLICA` for the "
                                 "replication mode")
            if fetch is None or fetch:
                raise ValueError("`experimental_place_dataset_on_device` can not be set to True "
                                 "when experimental_fetch_to_device is True and replication mode "
                                 "is set to `PER_REPLICA`")


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What a ``dataset_fn`` learns about its input pipeline (``tf.distribute.InputContext``).

    Args:
        num_input_pipelines: how many pipelines there are (one per worker, or per replica).
        input_pipeline_id: this pipeline's index, in ``[0, num_input_pipelines)``.
        num_replicas_in_sync: how many replicas a global batch is split over.

    Raises:
        ValueError: for counts that are not positive ints, or an id out of range.

    Example:
        >>> import jaxmirror
        >>> ctx = jaxmirror.InputContext(num_input_pipelines=1, input_pipeline_id=0,
        ...                              num_replicas_in_sync=2)
        >>> ctx.get_per_replica_batch_size(8)
        4
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self):
        for name in ("num_input_pipelines", "num_replicas_in_sync"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"InputContext: `{name}` must be a positive int; got {value!r}.")
        pid = self.input_pipeline_id
        if (not isinstance(pid, int) or isinstance(pid, bool)
                or not 0 <= pid < self.num_input_pipelines):
            raise ValueError(f"InputContext: `input_pipeline_id` must be an int in "
                             f"[0, {self.num_input_pipelines}); got {pid!r}.")

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The per-replica batch size for ``global_batch_size``.

        Args:
            global_batch_size: the global batch size, divisible by ``num_replicas_in_sync``.

        Returns:
            ``global_batch_size // num_replicas_in_sync``.

        Raises:
            ValueError: when ``global_batch_size`` is not divisible by ``num_replicas_in_sync``.

        Example:
            >>> import jaxmirror
            >>> jaxmirror.InputContext(num_replicas_in_sync=4).get_per_replica_batch_size(64)
            16
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                             f"`num_replicas_in_sync` {self.num_replicas_in_sync!r}")
        return global_batch_size // self.num_replicas_in_sync

    def __str__(self) -> str:
        return (f"jaxmirror.InputContext(input pipeline id {self.input_pipeline_id}, total: "
                f"{self.num_input_pipelines})")


def check_options(options, what: str) -> InputOptions:
    """``options``, or the default ``InputOptions()`` for ``None``; raises ``ValueError`` for
    anything else (``what`` names the API)."""
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise ValueError(f"{what}: `options` must be a jaxmirror.InputOptions or None; got "
                         f"{type(options).__name__}.")
    return options
