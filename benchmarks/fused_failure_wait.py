"""What a fused call's wait costs (issue 29): a failed call must raise itself and put its
batches back, so each call waits for its program. One fused NNX training loop (K = 4, a
24-layer 64-wide MLP, SGD, ``--devices`` replicas, 2 by default, of simulated CPU devices, or
GPUs with ``JAX_PLATFORMS=cuda``), no sync in the loop: median ms per call over 8 rounds of 30
calls. Nothing is compared: it times one loop.

Run from the repository root, against the tree before the wait for comparison:
    .venv/bin/python benchmarks/fused_failure_wait.py now
    git archive 0a3d976 jaxmirror | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base .venv/bin/python benchmarks/fused_failure_wait.py before
    JAX_PLATFORMS=cuda .venv/bin/python benchmarks/fused_failure_wait.py gpu --devices 1
"""
import sys, time, statistics, argparse  # noqa: E401
from _platform import simulated_cpu_devices
_FLAG = simulated_cpu_devices(8)
import jax, jax.numpy as jnp, numpy as np  # noqa: E401,E402
from flax import nnx  # noqa: E402
import optax  # noqa: E402
import jaxmirror as jm  # noqa: E402
from _timing import machine, too_few_devices  # noqa: E402
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("label", help="a name for this run's line (e.g. now, before)")
ap.add_argument("--devices", type=int, default=2, help="replicas")
ap.add_argument("--quick", action="store_true", help="2 rounds of 5 calls")
args = ap.parse_args()
if too_few_devices(args.devices, _FLAG):
    sys.exit(too_few_devices(args.devices, _FLAG))
print(f"# fused call wait: {machine()}; N = {args.devices}")
class MLP(nnx.Module):
    def __init__(self, n, rngs):
        self.layers = nnx.List([nnx.Linear(64, 64, rngs=rngs) for _ in range(n)])
    def __call__(self, x):
        for l in self.layers:
            x = jax.nn.relu(l(x))
        return x
s = jm.MirroredStrategy(jax.devices()[:args.devices])
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
for r in range(2 if args.quick else 8):
    t = time.perf_counter(); R = 5 if args.quick else 30
    for _ in range(R): out = f(it, model, opt)
    jax.block_until_ready((out, nnx.state(model)))
    res.append((time.perf_counter() - t) / R * 1e3)
print(args.label, f"median {statistics.median(res):.2f} ms per call", [round(x, 1) for x in res])
