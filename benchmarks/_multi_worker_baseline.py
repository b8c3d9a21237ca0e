"""The hand-written baseline of ``multi_worker.py``: the model, its data, and the same training
program written for several processes in plain JAX (no jaxmirror).

Imported by ``multi_worker.py`` and, by name, by its workers (``jaxmirror.launch.run`` gives
them the launcher's ``sys.path``). It imports no JAX at module level: a worker's strategy must
start ``jax.distributed`` before JAX's backend starts.
"""

from __future__ import annotations

import os
import time

import numpy as np

ON_CPU = os.environ.get("JAX_PLATFORMS", "cpu").split(",")[0] in ("", "cpu")
LR = 0.1


def host_batches(sizes, batch):
    """The 8 host global batches every loop cycles through (the same on every worker)."""
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(batch, sizes[0])).astype(np.float32),
             rng.integers(0, sizes[-1], size=batch).astype(np.int32)) for _ in range(8)]


def init_params(sizes):
    """The initial params, made on this process's first device (the same bits everywhere)."""
    import jax
    import jax.numpy as jnp

    key, params = jax.random.PRNGKey(0), {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, k = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(k, (a, b)) / np.sqrt(a)
        params[f"b{i}"] = jnp.zeros(b)
    return params


def per_example_loss(p, x, y):
    import jax
    import optax

    n = len(p) // 2
    for i in range(n):
        x = x @ p[f"w{i}"] + p[f"b{i}"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, y)


def hand_join():
    """The hand-written program's start: ``jax.distributed.initialize`` on loopback with the
    cluster ``TF_CONFIG`` names (``launch.run`` sets it), gloo for CPU collectives. A runtime
    already up (the strategy's, in the same worker) is reused, as the strategy reuses one."""
    import json

    import jax

    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    workers = config.get("cluster", {}).get("worker", [])
    if len(workers) > 1 and not jax.distributed.is_initialized():
        if ON_CPU:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(workers[0], len(workers), config["task"]["index"])


def hand_loop(sizes, batch, packed=False):
    """The same loop hand-written in plain JAX over every process's devices: ``loop(k)`` runs
    k steps; ``loop.losses`` lists the losses. ``packed``: one ``psum`` of the gradients
    flattened into one buffer (``ravel_pytree``), not one of the pytree (one operand a leaf)."""
    import itertools

    import jax
    from jax.flatten_util import ravel_pytree
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))  # process-major: process i's rows are block i
    rows, replicated = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    n, i = jax.process_count(), jax.process_index()
    local = batch // n
    mine = itertools.cycle([(x[i * local:(i + 1) * local], y[i * local:(i + 1) * local])
                            for x, y in host_batches(sizes, batch)])
    params = {k: jax.make_array_from_process_local_data(replicated, np.asarray(v))
              for k, v in init_params(sizes).items()}

    def body(p, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: jax.numpy.sum(per_example_loss(p, x, y)) / np.float32(batch))(p)
        if packed:
            flat, unravel = ravel_pytree(grads)
            grads = unravel(jax.lax.psum(flat, "x"))
        else:
            grads = jax.lax.psum(grads, "x")
        return jax.tree.map(lambda a, g: a - LR * g, p, grads), jax.lax.psum(loss, "x")

    body.__name__ = f"hand_{'packed' if packed else 'pytree'}_step"  # its HLO module's name
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x"), P("x")),
                                 out_specs=(P(), P()), check_vma=False))

    def loop(k):
        nonlocal params
        for _ in range(k):
            x, y = next(mine)
            x = jax.make_array_from_process_local_data(rows, x, (batch,) + x.shape[1:])
            y = jax.make_array_from_process_local_data(rows, y, (batch,))
            params, loss = step(params, x, y)
            loop.losses.append(float(loss))

    def split(k, phases):  # loop(k), each part's seconds added to ``phases``
        nonlocal params
        for _ in range(k):
            t = [time.perf_counter()]
            x, y = next(mine)
            x = jax.make_array_from_process_local_data(rows, x, (batch,) + x.shape[1:])
            y = jax.make_array_from_process_local_data(rows, y, (batch,))
            t.append(time.perf_counter())
            params, loss = step(params, x, y)
            t.append(time.perf_counter())
            loop.losses.append(float(loss))
            t.append(time.perf_counter())
            for part, a, b in zip(("next", "step call", "float"), t, t[1:]):
                phases[part] = phases.get(part, 0.0) + b - a

    loop.losses, loop.split = [], split
    return loop
