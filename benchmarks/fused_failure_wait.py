"""What a fused call's wait costs (issue 29): a failed call must raise itself and put its
batches back, so each call waits for its program. One fused NNX training loop (K = 4, a
24-layer 64-wide MLP, SGD, 2 replicas on simulated CPU devices), no sync in the loop: median ms
per call over 8 rounds of 30 calls.

Run from the repository root, against the tree before the wait for comparison:
    .venv/bin/python benchmarks/fused_failure_wait.py now
    git archive 0a3d976 jaxmirror | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base .venv/bin/python benchmarks/fused_failure_wait.py before
"""
import os, sys, time, statistics
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import optax
import jaxmirror as jm
class MLP(nnx.Module):
    def __init__(self, n, rngs):
        self.layers = nnx.List([nnx.Linear(64, 64, rngs=rngs) for _ in range(n)])
    def __call__(self, x):
        for l in self.layers:
            x = jax.nn.relu(l(x))
        return x
s = jm.MirroredStrategy(["CPU:0", "CPU:1"])
model = MLP(24, nnx.Rngs(0)); opt = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
s.experimental_replicate(model); s.experimental_replicate(opt)
def step(batch, model, opt):
    l, g = nnx.value_and_grad(lambda m: jnp.mean(m(batch) ** 2))(model)
    opt.update(model, jm.get_replica_context().all_reduce("mean", g))
    return l
K = 4
f = s.function(step, steps_per_execution=K)
data = [np.ones((8, 64), np.float32)] * (K * 2000)
it = iter(s.experimental_distribute_dataset(data))
for _ in range(5): f(it, model, opt)
res = []
for r in range(8):
    t = time.perf_counter(); R = 30
    for _ in range(R): out = f(it, model, opt)
    jax.block_until_ready((out, nnx.state(model)))
    res.append((time.perf_counter() - t) / R * 1e3)
print(sys.argv[1], f"median {statistics.median(res):.2f} ms per call", [round(x, 1) for x in res])
