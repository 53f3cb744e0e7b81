"""Subprocess body for the sharding test: argv = devices, mesh data, mesh fsdp, output .npz."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helpers
from devices import start_worker  # noqa: E402

n_dev, data, fsdp, out = start_worker()
import jax  # noqa: E402
import numpy as np  # noqa: E402
from trainer_util import tiny_config  # noqa: E402

from hilore_jax.rl import prompt_share, train_step  # noqa: E402
from hilore_jax.rl.update_batch import UpdateBatch  # noqa: E402
from hilore_jax.loop.trainer import Trainer  # noqa: E402

t = Trainer(tiny_config(out + ".run", f"mesh.data={data}", f"mesh.fsdp={fsdp}", "train.warmstart_steps=0",
                        "model.hidden_size=32", "train.microbatch_size=4", "grpo.beta=0.1", "grpo.num_iterations=2"))
rng = np.random.default_rng(0)
B, P, N = 12, 6, 3
prompt_mask = np.ones((B, P), np.int32)
prompt_mask[1, :2] = 0
host = UpdateBatch(rng.integers(3, 80, (B, P)).astype(np.int32), prompt_mask,
                    rng.integers(3, 80, (B, N)).astype(np.int32), (rng.random((B, N)) > 0.2).astype(np.int32),
                    rng.normal(size=B).astype(np.float32), old_logp=-rng.random((B, N)).astype(np.float32) * 3,
                    ref_logp=-rng.random((B, N)).astype(np.float32) * 3)
batch = t.place(host)
grad_fn = jax.jit(train_step.grads_and_stats, static_argnums=2)
grads, stats = grad_fn(t.state["params"], batch, t.spec)
# groups of two rows per prompt, with a prompt table (replicated) and per-row indices (split over the mesh): the
# shared gradient on any mesh equals the unshared one
pairs = np.repeat(np.arange(0, B, 2), 2)
grouped = host.replace(prompt_ids=host.prompt_ids[pairs], prompt_mask=host.prompt_mask[pairs])
shared = prompt_share.share_all([grouped], t.spec.microbatches)[0]
assert prompt_share.shared(shared)
shared_grads, shared_stats = grad_fn(t.state["params"], t.place(shared), t.spec)
grouped_grads, _ = grad_fn(t.state["params"], t.place(grouped), t.spec)
state, metrics = t.stepper(t.spec, t.state, batch)
wgate = state["params"]["layers"]["mlp"]["wgate_DF"]  # the train layout: [layers, D, F], fsdp on D
wgate_spec, wgate_rows = str(wgate.sharding.spec), wgate.addressable_shards[0].data.shape[1]
new_wgate = np.asarray(wgate)[0]
_, shared_metrics = t.stepper(t.spec, state, t.place(shared))  # the compiled step takes the table replicated


def flat(tree, prefix):
  return {prefix + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(v)
          for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


np.savez(out, loss=np.asarray(stats["loss"]), new_wgate=new_wgate, metric_loss=np.asarray(metrics["loss"]),
         wgate_spec=wgate_spec, wgate_shard_rows=wgate_rows,
         shared_loss=np.asarray(shared_stats["loss"]), shared_metric_loss=np.asarray(shared_metrics["loss"]),
         **flat(grads, "g/"), **flat(shared_grads, "s/"), **flat(grouped_grads, "u/"))
