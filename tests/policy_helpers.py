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
