"""Train a small MLP on scikit-learn's digits with ``MirroredStrategy``, and check it against one device.

The demo is the TF ``MirroredStrategy`` custom-training-loop recipe written with jaxmirror and
plain JAX: the step is written for one replica, losses are scaled with
``compute_average_loss``, gradients are summed with ``get_replica_context().all_reduce`` and
the optimizer update runs on every replica. The same model is then trained on one device with a
plain ``jax.jit`` step over the same global batches, and the two runs are compared: the final
parameters and the per-step losses must agree to within ``2e-5``, and the test accuracy must be
at least ``0.9``; otherwise the demo exits with status 1.

Without a GPU the demo simulates 8 CPU devices (``configure_cpu_devices(8)``), so
``MirroredStrategy()`` runs 8 replicas; on a GPU machine it takes every local GPU.

Example:
    Run it from a shell (``make demo`` does the same)::

        python examples/demo.py --epochs 4 --batch-size 64

    or from Python (with ``examples/`` on the path), in a process where JAX has not started
    yet (or runs with 8 CPU devices)::

        >>> import demo
        >>> results = demo.main(["--epochs", "2", "--no-progress"])  # doctest: +SKIP
        >>> results["max_param_diff"] <= 2e-5  # doctest: +SKIP
        True
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import jaxmirror

NUM_CPU_DEVICES = 8
TOLERANCE = 2e-5
MIN_ACCURACY = 0.9


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the demo's command line.

    Args:
        argv: the arguments, without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The parsed options (``epochs``, ``batch_size``, ``hidden``, ``learning_rate``, ``seed``,
        ``test_fraction``, ``no_progress``).
    """
    p = argparse.ArgumentParser(
        prog="python examples/demo.py",
        description="Train an MLP on sklearn's digits with jaxmirror.MirroredStrategy and compare "
                    "it with the same training on one device.",
    )
    p.add_argument("--epochs", type=int, default=5, help="passes over the training set (default 5)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="GLOBAL batch size; rounded down to a multiple of the replica count "
                        "(default 64)")
    p.add_argument("--hidden", type=int, default=64, help="hidden units (default 64)")
    p.add_argument("--learning-rate", type=float, default=1e-2, help="Adam step size (default 1e-2)")
    p.add_argument("--seed", type=int, default=0, help="seed for the split, init and shuffling")
    p.add_argument("--test-fraction", type=float, default=0.25, help="held-out share (default 0.25)")
    p.add_argument("--no-progress", action="store_true", help="hide the tqdm progress bar")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.hidden < 1:
        p.error("--epochs, --batch-size and --hidden must be positive")
    return args


def _setup_devices() -> None:
    """Simulate 8 CPU devices, unless JAX already runs (then use the devices it has)."""
    try:
        jaxmirror.configure_cpu_devices(NUM_CPU_DEVICES)
    except RuntimeError as err:  # e.g. main() called in a process where JAX already started
        warnings.warn(f"{err} Going on with the devices JAX has.", stacklevel=3)


def load_data(test_fraction: float = 0.25, seed: int = 0):
    """Load sklearn's bundled digits (8x8 images, 10 classes), standardised and split.

    Args:
        test_fraction: share of the 1797 examples held out for testing.
        seed: seed of the stratified split.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: float32 features of shape ``(n, 64)``, standardised
        with the training set's statistics, and int32 labels.
    """
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_train)
    return (scaler.transform(x_train).astype(np.float32), y_train.astype(np.int32),
            scaler.transform(x_test).astype(np.float32), y_test.astype(np.int32))


def make_batches(x, y, batch_size: int, epochs: int, seed: int = 0) -> list:
    """Shuffle each epoch and cut it into full global batches (the remainder is dropped).

    Args:
        x: features, shape ``(n, d)``.
        y: labels, shape ``(n,)``.
        batch_size: the global batch size.
        epochs: how many shuffled passes to make.
        seed: seed of the shuffles.

    Returns:
        A list of ``(x_batch, y_batch)`` NumPy pairs, ``epochs * (n // batch_size)`` of them.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    steps = len(x) // batch_size
    batches = []
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for i in range(steps):
            idx = order[i * batch_size:(i + 1) * batch_size]
            batches.append((x[idx], y[idx]))
    return batches


def init_params(seed: int, sizes) -> dict:
    """He-initialised weights and zero biases of an MLP, as a dict pytree.

    The weights are drawn with NumPy: on CPU, compiling ``jax.random.normal`` takes longer
    than the whole training run.

    Args:
        seed: seed of the draw.
        sizes: layer widths, input first, e.g. ``(64, 64, 10)``.

    Returns:
        ``{"w0": ..., "b0": ..., "w1": ..., ...}`` of float32 NumPy arrays.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (rng.standard_normal((m, n)) * np.sqrt(2.0 / m)).astype(np.float32)
        params[f"b{i}"] = np.zeros((n,), np.float32)
    return params


def apply(params: dict, x):
    """The MLP's logits: ReLU hidden layers, linear output.

    Matmuls use full float32 precision, so GPUs (TF32 by default) agree with the CPU reference.

    Args:
        params: the dict made by ``init_params``.
        x: inputs, shape ``(batch, features)``.

    Returns:
        Logits, shape ``(batch, classes)``.
    """
    import jax
    import jax.numpy as jnp

    layers = len(params) // 2
    for i in range(layers):
        x = jnp.dot(x, params[f"w{i}"], precision=jax.lax.Precision.HIGHEST) + params[f"b{i}"]
        if i < layers - 1:
            x = jax.nn.relu(x)
    return x


def per_example_loss(params: dict, x, y):
    """Softmax cross-entropy of each example.

    Args:
        params: the MLP's parameters.
        x: inputs, shape ``(batch, features)``.
        y: integer labels, shape ``(batch,)``.

    Returns:
        Losses, shape ``(batch,)``.
    """
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y)


def train_distributed(strategy, params, optimizer, batches, progress: bool = True):
    """Train with ``strategy``: the TF custom-training-loop recipe, step by step.

    Args:
        strategy: a jaxmirror strategy (here ``MirroredStrategy()``).
        params: initial parameters (a pytree of arrays).
        optimizer: an ``optax.GradientTransformation``.
        batches: a list of global ``(x, y)`` batches, each divisible by the replica count.
        progress: show a tqdm progress bar.

    Returns:
        ``(params, losses, elapsed, traces)``: final parameters (replicated ``jax.Array``s), the
        global mean loss of every step (NumPy), the wall time in seconds of the
        ``len(batches) - 1`` steps after the first, compiling one, and how often the step was
        traced (1 unless something forced a retrace).
    """
    import jax
    import numpy as np
    import optax
    from tqdm.auto import tqdm

    @strategy.run
    def train_step(params, opt_state, batch):
        x, y = batch

        def loss_fn(p):
            # Sum of this replica's losses / GLOBAL batch size, as in TF.
            return jaxmirror.compute_average_loss(per_example_loss(p, x, y))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jaxmirror.get_replica_context().all_reduce("sum", grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # Start from state replicated on the strategy's devices (TF: variables made in scope()),
    # so every step, the first included, sees the same input shardings: one compilation.
    replicated = strategy.extended.replicated_sharding
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)

    dist_dataset = strategy.experimental_distribute_dataset(batches)
    losses = []
    start = None
    bar = tqdm(dist_dataset, total=len(batches), desc=f"{strategy.num_replicas_in_sync} replicas",
               unit="step", disable=not progress)
    for step, batch in enumerate(bar):
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(strategy.reduce("sum", loss, axis=None))
        if step == 0:
            jax.block_until_ready(params)
            start = time.perf_counter()
        elif step % 20 == 0 and progress:
            bar.set_postfix(loss=f"{float(losses[-1]):.4f}")
    jax.block_until_ready((params, losses))
    elapsed = time.perf_counter() - start
    bar.close()
    return params, np.asarray(jax.device_get(losses), np.float64), elapsed, train_step.trace_count


def train_single_device(params, optimizer, batches):
    """The reference: the same training on one device with a plain ``jax.jit`` step.

    Args:
        params: initial parameters.
        optimizer: an ``optax.GradientTransformation``.
        batches: the same global batches the distributed run used.

    Returns:
        ``(params, losses, elapsed)``: final parameters, the loss of every step (NumPy) and the
        wall time in seconds of the steps after the first, compiling one.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean(per_example_loss(p, x, y)))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    device = jax.devices()[0]
    params = jax.device_put(params, device)
    opt_state = jax.device_put(optimizer.init(params), device)
    losses = []
    start = None
    for step, (x, y) in enumerate(batches):
        params, opt_state, loss = train_step(params, opt_state, x, y)
        losses.append(loss)
        if step == 0:
            jax.block_until_ready(params)
            start = time.perf_counter()
    jax.block_until_ready((params, losses))
    elapsed = time.perf_counter() - start
    return params, np.asarray(jax.device_get(losses), np.float64), elapsed


def accuracy(params, x, y) -> float:
    """Share of ``x`` whose arg-max logit is the label.

    Args:
        params: the MLP's parameters.
        x: inputs.
        y: integer labels.

    Returns:
        The accuracy, a float in [0, 1].
    """
    import jax
    import numpy as np

    params = jax.device_get(params)
    h = np.asarray(x, np.float32)
    layers = len(params) // 2
    for i in range(layers):  # the MLP in NumPy: no compilation for a one-off evaluation
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            h = np.maximum(h, 0)
    return float(np.mean(h.argmax(-1) == y))


def main(argv=None) -> dict:
    """Run the demo: distributed training, single-device reference, comparison.

    Args:
        argv: command-line arguments (see ``python examples/demo.py --help``); ``None`` reads
            ``sys.argv[1:]``.

    Returns:
        A dict with ``accuracy`` (test accuracy of the distributed model), ``single_accuracy``,
        ``max_param_diff`` and ``max_loss_diff`` (largest absolute differences between the two
        runs' final parameters and per-step losses), ``step_time_ms`` and
        ``single_step_time_ms`` (mean step time, first compiling step excluded),
        ``num_replicas``, ``traces`` (how often the distributed step was traced), ``steps``,
        ``global_batch_size``, ``final_loss`` (the last step's loss) and ``ok``.

    Raises:
        SystemExit: with status 1 when a difference exceeds ``2e-5`` or the accuracy is below
            ``0.9`` (status 2 for bad arguments).
    """
    args = parse_args(argv)
    _setup_devices()  # before anything starts JAX's backend

    import jax
    import numpy as np
    import optax

    strategy = jaxmirror.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    batch_size = max(n, args.batch_size - args.batch_size % n)

    x_train, y_train, x_test, y_test = load_data(args.test_fraction, args.seed)
    batches = make_batches(x_train, y_train, batch_size, args.epochs, args.seed)
    if len(batches) < 2:
        raise SystemExit(f"need at least 2 steps; got {len(batches)} (lower --batch-size or raise "
                         f"--epochs)")
    sizes = (x_train.shape[1], args.hidden, int(y_train.max()) + 1)
    init = init_params(args.seed, sizes)
    optimizer = optax.adam(args.learning_rate)

    print(f"jaxmirror demo: {strategy!r} on {jax.devices()[0].platform.upper()}, "
          f"{len(x_train)} train / {len(x_test)} test digits, global batch {batch_size} "
          f"({batch_size // n} per replica), {len(batches)} steps")
    dist_params, dist_losses, dist_time, traces = train_distributed(
        strategy, init, optimizer, batches, progress=not args.no_progress)
    single_params, single_losses, single_time = train_single_device(init, optimizer, batches)

    dist_host = jax.device_get(dist_params)
    single_host = jax.device_get(single_params)
    max_param_diff = max(float(np.max(np.abs(a - b)))
                         for a, b in zip(jax.tree.leaves(dist_host), jax.tree.leaves(single_host)))
    max_loss_diff = float(np.max(np.abs(dist_losses - single_losses)))
    acc = accuracy(dist_host, x_test, y_test)
    results = {
        "accuracy": acc,
        "single_accuracy": accuracy(single_host, x_test, y_test),
        "max_param_diff": max_param_diff,
        "max_loss_diff": max_loss_diff,
        "step_time_ms": 1e3 * dist_time / (len(batches) - 1),
        "single_step_time_ms": 1e3 * single_time / (len(batches) - 1),
        "num_replicas": n,
        "traces": traces,
        "steps": len(batches),
        "global_batch_size": batch_size,
        "final_loss": float(dist_losses[-1]),
    }
    results["ok"] = (max_param_diff <= TOLERANCE and max_loss_diff <= TOLERANCE
                     and acc >= MIN_ACCURACY)

    print(f"last step loss             {results['final_loss']:.4f}")
    print(f"test accuracy              {acc:.4f} (single device: {results['single_accuracy']:.4f})")
    print(f"mean step time             {results['step_time_ms']:.2f} ms with {n} replicas, "
          f"{results['single_step_time_ms']:.2f} ms on one device (first step excluded)")
    print(f"max |param difference|     {max_param_diff:.3e} (tolerance {TOLERANCE:g})")
    print(f"max |loss difference|      {max_loss_diff:.3e} (tolerance {TOLERANCE:g})")
    if not results["ok"]:
        print(f"FAILED: differences must be <= {TOLERANCE:g} and accuracy >= {MIN_ACCURACY}",
              file=sys.stderr)
        raise SystemExit(1)
    print("OK: the distributed run matches the single-device run")
    print("next: .venv/bin/jupyter lab notebooks/  (01_quickstart, then 04_custom_training);"
          " make docs  (the porting guide from tf.distribute: build/docs/porting.html)")
    return results


if __name__ == "__main__":
    main()
