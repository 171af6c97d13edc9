"""Update nodes: one PPO or GRPO optimization step per batch, publishing versioned weights.

* :class:`PPOUpdate`: clipped policy loss (``nodes.rl.losses.ppo_policy_loss``), clipped value loss
  on a separate critic (``value_loss``), an optional entropy bonus and an optional k3
  KL-to-reference loss term. Trains its own copy of the policy and its own value model, built
  from the same specs as the rollout and critic nodes so that all start identical, and emits
  their weights for those nodes' ``weights`` inputs.
* :class:`GRPOUpdate`: ``nodes.rl.losses.grpo_loss`` (group advantages, no critic).

Each call runs ``epochs`` passes over the batch; a pass is ``mini_batches`` optimizer steps,
each on its share of the batch (whole prompts' rows, shuffled with the step's seed; one: the
whole batch, as it came). Each step's mini-batch is cut into micro-batches whose gradients are
accumulated before the step: by ``micro_batch_tokens``, a budget of padded tokens (rows times
the longest prompt plus the longest response of the micro-batch), rows sorted longest first
and each micro-batch trimmed of the padding it does not use (:mod:`nodes.update.trainer`), so the
forward's memory is bounded whatever the batch; else by ``micro_batch_size`` rows (0: whole).
Every micro-batch loss is weighted by its share of the mini-batch's real tokens (token-mean
terms) or of its non-empty samples (seq-mean terms), so the accumulated gradient equals the
unsplit one up to float rounding. When image inputs come one row per prompt (B = N * n),
micro-batches hold whole groups of n rows. Gradients are freed after the last step of a call.
Every call publishes new weight versions, also when its steps were skipped.

``mixed_precision="bf16"`` runs the trained models' forward passes under bfloat16 autocast
with float32 master weights and AdamW state; ``lr_schedule`` / ``lr_warmup_steps`` /
``lr_decay_steps`` set the learning rate per training step (:mod:`nodes.update.schedule`).

A non-finite policy logprob, value, loss or gradient (norm) skips the step: gradients are
zeroed, no optimizer steps, ``metrics["skipped_nonfinite"]`` is 1.0 and the remaining epochs
of the call are dropped (they would see the same batch and weights as the failed one). The
weights are checked after every optimizer step (one fused norm per model): a step that leaves
them non-finite or too large to square, or after which the next epoch's values are not finite
(the same batch was fine before it), is undone:
the weights from before it are put back (a copy of the trained weights is kept during a call
for this; the optimizer's moments keep that step's gradient). With ``on_nonfinite="raise"`` a
:class:`NonFiniteError` (a ``UsageError``) names the node and the quantity instead. Non-finite
*inputs* (advantages, returns, ...) at real tokens are bad data and always a ValueError.

The models run in eval mode (dropout off), as the rollout samples: a PPO ratio must compare the
very function that sampled the tokens.

With ``ranks=K`` (K > 1) an update trains as one SPMD group of K processes under
torch.distributed, and the graph still sees one node. The node that the executor builds is
rank 0; the executor starts the other ranks, hands the node its group (``runtime.ranks``) and
runs every call and state operation on all of them alike: the node's code is SPMD.
Each call's batch is split across the ranks by token count, and the models are sharded by
FSDP2 (``train_backend="fsdp"``) or replicated by DDP, through that group. Loss weights
are shares of the whole batch, so the step equals the 1-rank step up to float rounding. The
published weights and the checkpointed state are gathered onto rank 0, unsharded and in the
1-rank layout, so a checkpoint resumes with any K. A rank that dies is a
``RankError`` (``runtime.ranks``) that names it. ``close()`` ends the group, and the
ranks also exit when rank 0 does. One process holds one group at a time, and all ranks run
on rank 0's host.
"""

from nodes.update.grpo import GRPOUpdate
from nodes.update.ppo import PPOUpdate

__all__ = ["GRPOUpdate", "PPOUpdate"]
