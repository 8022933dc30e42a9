"""A user's own TensorFlow training script in script mode (train_tf.yaml): MultiWorkerMirroredStrategy across the
job's processes, configured by the TF_CONFIG the platform injects (one worker per rank); the job's data in the
platform's deterministic order and metrics into the job's events through `trainforge.runtime`.

The model is a small bigram language model (embedding -> logits) trained with Adam written in plain TensorFlow,
in a custom loop: each worker computes gradients on its rows of the global batch, all-reduced across workers.

    trainforge submit examples/script_mode/train_tf.yaml
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from trainforge import runtime  # noqa: E402


def main() -> None:
    job = runtime.init()  # TensorFlow: no process group; the strategy below reads TF_CONFIG
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    vocab, hidden = job.model["vocab"], job.model["hidden"]
    opt = job.training["optimizer"]
    lr, (b1, b2), eps = opt["lr"], opt["betas"], opt["eps"]
    tf.random.set_seed(job.seed)  # every worker starts from the same weights
    init_embed = tf.random.stateless_normal((vocab, hidden), seed=(job.seed, 1)) * 0.02
    init_out = tf.random.stateless_normal((hidden, vocab), seed=(job.seed, 2)) * 0.02
    with strategy.scope():
        params = [tf.Variable(init_embed), tf.Variable(init_out)]
        m = [tf.Variable(tf.zeros_like(p)) for p in params]
        v = [tf.Variable(tf.zeros_like(p)) for p in params]

    def replica_step(tokens: tf.Tensor, t: tf.Tensor) -> tf.Tensor:
        x, y = tokens[:, :-1], tokens[:, 1:]
        with tf.GradientTape() as tape:
            logits = tf.gather(params[0], x) @ params[1]
            per_token = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            # this worker's share of the global mean: the all-reduced sum below is the global batch's gradient
            loss = tf.reduce_sum(per_token) / float(job.global_batch_size * job.seq_len)
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, params)]
        grads = tf.distribute.get_replica_context().all_reduce("sum", grads)
        step_size = lr * tf.sqrt(1 - b2**t) / (1 - b1**t)
        for p, a, b, g in zip(params, m, v, grads, strict=True):
            a.assign(b1 * a + (1 - b1) * g)
            b.assign(b2 * b + (1 - b2) * g * g)
            p.assign_sub(step_size * a / (tf.sqrt(b) + eps))
        return loss

    @tf.function
    def train_step(tokens: tf.Tensor, t: tf.Tensor) -> tf.Tensor:
        return strategy.reduce("SUM", strategy.run(replica_step, args=(tokens, t)), axis=None)

    done = 0
    for step, rows in runtime.data_loader():  # this worker's rows of the step's global batch
        loss = train_step(tf.constant(rows, dtype=tf.int32), tf.constant(float(step + 1)))
        runtime.log_metrics(step + 1, loss=float(loss))  # the global loss: the same on every worker
        done = step + 1
    runtime.finish(done)


if __name__ == "__main__":
    main()
