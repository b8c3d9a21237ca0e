"""What a dataset can be: each kind becomes a factory of per-epoch iterators of host batches.

Accepted: re-iterables (lists, tuples, objects with ``__iter__`` that start over each time),
zero-argument factories returning an iterable (how to pass a generator), one-shot iterators
(one epoch), and, recognised by their module so none of them is imported or required:
``tf.data.Dataset`` (read with ``as_numpy_iterator``), ``torch.utils.data.DataLoader`` (tensors
become NumPy arrays) and grain's ``MapDataset``/``IterDataset``/``DataLoader``.
"""

from __future__ import annotations

import collections.abc

import jax
import numpy as np


def _module_root(obj) -> str:
    return type(obj).__module__.split(".", 1)[0]


def _torch_to_numpy(batch):
    def leaf(x):
        if hasattr(x, "detach") and hasattr(x, "numpy"):  # a torch.Tensor
            return x.detach().cpu().numpy()
        return x

    return jax.tree.map(leaf, batch)


class OneShot:
    """A one-shot iterator as an epoch factory: one epoch, then a clear error instead of a
    silent empty epoch.

    Args:
        iterator: the iterator.
        what: the API name, for errors.
    """

    def __init__(self, iterator, what: str):
        self._iterator = iterator
        self._used = False
        self._what = what

    def __call__(self):
        if self._used:
            raise ValueError(
                f"{self._what}: `dataset` was a one-shot iterator (e.g. a generator) and its one "
                f"epoch is used up; pass a re-iterable, or a zero-argument function that returns "
                f"a new iterator, to iterate again."
            )
        self._used = True
        return self._iterator


def epoch_factory(dataset, what: str):
    """A zero-argument function giving a fresh iterator of host batches per call (per epoch).

    Args:
        dataset: any of the kinds this module accepts.
        what: the API name, for error messages.

    Returns:
        The factory.

    Raises:
        ValueError: for something that is not a dataset (one array, a dict, a string, ...).

    Example:
        >>> import numpy as np
        >>> make = epoch_factory([np.zeros(2), np.ones(2)], "demo")
        >>> len(list(make())), len(list(make()))
        (2, 2)
    """
    root = _module_root(dataset)
    if root == "tensorflow" and hasattr(dataset, "as_numpy_iterator"):
        return dataset.as_numpy_iterator
    if root == "torch" and isinstance(dataset, collections.abc.Iterable):
        return lambda: map(_torch_to_numpy, iter(dataset))
    if isinstance(dataset, (np.ndarray, jax.Array)):
        raise ValueError(
            f"{what}: `dataset` is a single array of shape {tuple(dataset.shape)}, not a "
            f"dataset of batches; pass a list of batches (e.g. np.array_split(x, num_batches)), "
            f"a generator function, or a grain/tf.data/torch dataset batched by the global "
            f"batch size."
        )
    if isinstance(dataset, (str, bytes, dict, collections.abc.Mapping)):
        raise ValueError(f"{what}: `dataset` must be an iterable of batches; got a "
                         f"{type(dataset).__name__}; wrap one batch in a list: [batch].")
    if isinstance(dataset, collections.abc.Iterator):
        return OneShot(dataset, what)
    if isinstance(dataset, collections.abc.Iterable):  # lists, grain datasets and loaders, ...
        return lambda: iter(dataset)
    if callable(dataset):
        def fresh():
            made = dataset()
            if not isinstance(made, collections.abc.Iterable):
                raise ValueError(f"{what}: the dataset function returned a "
                                 f"{type(made).__name__}, not an iterable of batches; return a "
                                 f"list, a generator or a dataset of batches.")
            return iter(epoch_factory(made, what)())
        return fresh
    raise ValueError(f"{what}: `dataset` must be an iterable of batches, a function returning "
                     f"one, or a grain/tf.data/torch dataset; got {type(dataset).__name__}.")


def peeked(factory, read_first, what):
    """``factory`` after its source's first batch was read: one-shot sources get it back.

    Args:
        factory: a dataset's epoch factory (``sources.epoch_factory``).
        read_first: the dataset's ``_read_first``.
        what: the API name, for errors.

    Returns:
        A factory whose next epoch starts with the batch already read.
    """
    if isinstance(factory, OneShot):
        source = read_first(factory())
        return OneShot(source, what)
    read_first(factory())
    return factory
