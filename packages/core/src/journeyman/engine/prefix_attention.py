"""Decode attention that reads a prompt prefix shared by every row of a batch once, not once a row.

Agent prompts are mostly a prefix every rollout shares (system prompt, tool definitions: ~570 of
~600 tokens on an MCP server). The engine computes its keys and values once (`TorchEngine.
_shared_prefix`) but the static cache holds a copy per row, and attention reads every copy at every
decoded token, which on the CPU makes a token take about half as long again (docs/). Here the
queries of all rows meet the prefix's keys in one matrix product (row 0's copy), the rows' own
tokens as before, and one softmax spans both (cascade attention, as FlashInfer calls it).

Used only where it is the same computation as the model's own attention: one query token, no
sliding window, no logit soft-capping, no dropout; anything else goes to the model's own function.
It is registered with transformers by `register_prefix_attention`, which `prefix_attention` calls,
never on import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from journeyman.policy.lora import attention_implementation

__all__ = ["PREFIX_ATTENTION", "prefix_attention", "register_prefix_attention", "shared_prefix_attention"]

PREFIX_ATTENTION = "journeyman_shared_prefix"


def shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, heads, q, d)
    key: torch.Tensor,  # (B, kv heads, slots, d)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # (B, 1, q, slots) bool, True = attend (SDPA's mask)
    *,
    prefix_slots: int = 0,
    prefix_attention: str = "sdpa",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The model's attention, with the first `prefix_slots` cache slots (the same keys and values in
    every row) read once for the batch when one token is decoded per row."""
    b, heads, q_len, d = query.shape
    if (
        prefix_slots <= 0
        or q_len != 1
        or b == 1
        or attention_mask is None
        or attention_mask.dtype != torch.bool
        or attention_mask.shape[-1] != key.shape[2]
        or kwargs.get("sliding_window") is not None
        or kwargs.get("softcap") is not None
        or (kwargs.get("dropout") and module.training)
    ):
        return ALL_ATTENTION_FUNCTIONS[prefix_attention](module, query, key, value, attention_mask, **kwargs)
    kv_heads = key.shape[1]
    rep = heads // kv_heads  # query head h reads kv head h // rep (grouped-query attention)
    scale = kwargs.get("scaling") or d**-0.5
    p = prefix_slots
    q = query.view(b, kv_heads, rep, d).float()
    k_pre, v_pre = key[0, :, :p].float(), value[0, :, :p].float()  # (kv heads, P, d), row 0's copy
    k_own, v_own = key[:, :, p:].float(), value[:, :, p:].float()  # (B, kv heads, S, d)
    # every row's queries against the prefix in one product: (kv heads, B * rep, P)
    q_pre = q.permute(1, 0, 2, 3).reshape(kv_heads, b * rep, d)
    s_pre = torch.bmm(q_pre, k_pre.transpose(1, 2)).view(kv_heads, b, rep, p).permute(1, 0, 2, 3)
    s_own = q @ k_own.transpose(-1, -2)  # (B, kv heads, rep, S)
    scores = torch.cat([s_pre, s_own], dim=-1).mul_(scale)  # (B, kv heads, rep, P + S)
    scores.masked_fill_(~attention_mask, float("-inf"))  # mask (B, 1, 1, slots)
    probs = torch.softmax(scores, dim=-1)
    p_pre = probs[..., :p].permute(1, 0, 2, 3).reshape(kv_heads, b * rep, p)
    out = torch.bmm(p_pre, v_pre).view(kv_heads, b, rep, d).permute(1, 0, 2, 3) + probs[..., p:] @ v_own
    return out.reshape(b, heads, 1, d).transpose(1, 2).to(query.dtype), None  # (B, 1, heads, d)


def register_prefix_attention() -> str:
    """Make `shared_prefix_attention` known to transformers as `PREFIX_ATTENTION`, with SDPA's masks
    (once; later calls change nothing); returns the name to set as a model's attention implementation."""
    if ALL_ATTENTION_FUNCTIONS.get(PREFIX_ATTENTION) is not shared_prefix_attention:
        AttentionInterface.register(PREFIX_ATTENTION, shared_prefix_attention)
    if ALL_MASK_ATTENTION_FUNCTIONS.get(PREFIX_ATTENTION) is not sdpa_mask:
        ALL_MASK_ATTENTION_FUNCTIONS.register(PREFIX_ATTENTION, sdpa_mask)  # the masks SDPA gets
    return PREFIX_ATTENTION


@contextlib.contextmanager
def prefix_attention(causal_lm: Any) -> Iterator[str | None]:
    """`shared_prefix_attention` for the block, for a model on SDPA on the CPU; yields the name of
    the model's own attention to hand it as `prefix_attention`, or None where it is left as it is
    (on CUDA this is not measured; other attention implementations take other masks)."""
    if causal_lm.config._attn_implementation != "sdpa" or causal_lm.device.type != "cpu":
        yield None
        return
    with attention_implementation(causal_lm, register_prefix_attention()) as inner:
        yield inner
