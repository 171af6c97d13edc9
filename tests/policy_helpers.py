"""Policy helpers shared by the model-family tests: token ids of texts, the logits of a fixed
batch, and LoRA adapters made to matter."""

import torch

PROMPTS = ["hi", "what colour is it?", "x"]


def _ids(policy, texts):
    """Right-padded ids and mask of ``texts`` under the policy's tokenizer."""
    rows = [policy.tokenizer(t).input_ids for t in texts]
    R = max(len(r) for r in rows)
    ids = torch.tensor([r + [policy.pad_token_id] * (R - len(r)) for r in rows])
    mask = (torch.arange(R)[None] < torch.tensor([[len(r)] for r in rows])).float()
    return ids, mask


def _logits(policy, **kw):
    """The policy's logits over three fixed responses to :data:`PROMPTS`."""
    ids, mask = _ids(policy, ["abc", "de", "f"])
    with torch.no_grad():
        return policy.forward_logits(policy.encode_prompts(PROMPTS, **kw), ids, mask)


def _perturb_adapters(policy, seed=1):
    """LoRA's B starts at zero (the adapter is a no-op); give it weights that change logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def sampled_batch(prompts, n=4):
    """The tiny prefix-VLM's rollout of ``n`` responses to each of ``prompts`` (8 tokens at
    most, seeded), image embeddings one row per prompt, and advantages of +1 / -1 by row:
    ``(rollout outputs, the four token ports, embeddings, advantages)``."""
    from nodes.rl.advantages import broadcast_to_tokens
    from nodes.rollout import Rollout

    embeds = torch.randn(len(prompts), 32, generator=torch.Generator().manual_seed(0))
    out = Rollout(n=n, max_new_tokens=8, seed=0).run(prompts=prompts, image_embeds=embeds)
    ports = {k: out[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    scores = torch.tensor([1.0, -1.0] * (out["response_ids"].shape[0] // 2))  # (B,)
    return out, ports, embeds, broadcast_to_tokens(scores, out["response_mask"])  # (B, R)
