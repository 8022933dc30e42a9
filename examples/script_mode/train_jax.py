"""A user's own JAX training script in script mode (train_jax.yaml): data-parallel over processes with
`jax.distributed` (started by `trainforge.runtime.init()` from the injected JAX_* variables; gloo collectives on
CPU), the job's data in the platform's deterministic order, metrics into the job's events.

The model is a small bigram language model (embedding -> logits) trained with Adam written in plain jax.numpy, so
the example needs nothing but jax. Each process feeds its rows of the global batch; `jax.jit` over a mesh of all
processes' devices averages the gradients across processes.

    trainforge submit examples/script_mode/train_jax.yaml
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainforge import runtime


def loss_fn(params: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits = params["embed"][x] @ params["out"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()


def main() -> None:
    job = runtime.init()  # jax.distributed.initialize(coordinator, num_processes, process_id) from the env
    vocab, hidden = job.model["vocab"], job.model["hidden"]
    key = jax.random.PRNGKey(job.seed)  # every process starts from the same weights
    k1, k2 = jax.random.split(key)
    params = {"embed": jax.random.normal(k1, (vocab, hidden)) * 0.02,
              "out": jax.random.normal(k2, (hidden, vocab)) * 0.02}
    opt = job.training["optimizer"]
    lr, (b1, b2), eps = opt["lr"], opt["betas"], opt["eps"]
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)

    mesh = Mesh(np.array(jax.devices()), ("dp",))  # one device per process on CPU
    batch_sharding = NamedSharding(mesh, P("dp"))
    replicated = NamedSharding(mesh, P())
    params, m, v = jax.device_put((params, m, v), replicated)

    @jax.jit
    def train_step(params, m, v, tokens, t):  # type: ignore[no-untyped-def]
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)  # mean over the global batch: all processes
        m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
        step_size = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
        params = jax.tree.map(lambda p, a, b: p - step_size * a / (jnp.sqrt(b) + eps), params, m, v)
        return params, m, v, loss

    done = 0
    for step, rows in runtime.data_loader():  # this process's rows of the step's global batch
        tokens = jax.make_array_from_process_local_data(batch_sharding, rows.astype(np.int32))
        params, m, v, loss = train_step(params, m, v, tokens, step + 1)
        runtime.log_metrics(step + 1, loss=float(loss))  # the global loss: the same on every process
        done = step + 1
    runtime.finish(done)  # segment_end for the flow, then jax.distributed.shutdown()


if __name__ == "__main__":
    main()
