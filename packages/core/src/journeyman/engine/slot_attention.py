"""The engine's attention over row slots and a shared prefix (`kv`): what the model's own attention
computes, for rows that each hold their own tokens in a slot and may read the first `p` tokens of
one prefix that is stored once for the whole batch.

Every query meets the prefix's keys in one matrix product for all rows (cascade attention, as
FlashInfer calls it), its own row's slots in another, and one softmax spans both. The mask is the
plan's (`KVPlan`): transformers builds none for an implementation it has no mask function for, so
no (rows, slots) mask is made per layer. Registered with transformers by `slot_attention_on`, never
on import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from journeyman.engine.kv import KVPlan
from journeyman.policy.lora import attention_implementation

__all__ = ["SLOT_ATTENTION", "slot_attention", "slot_attention_on", "unsupported_attention"]

SLOT_ATTENTION = "journeyman_slots"


def unsupported_attention(config: Any) -> str | None:
    """Why the in-process engine cannot serve a model of `config`, or None: soft-capped attention
    or output logits are not what `slot_attention` and the engine's head compute."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            return f"{name}={getattr(config, name)}"
    return None


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (n, heads, q, d)
    key: torch.Tensor,  # (n, kv heads, kv_len, d): the rows' slots (`KVPlan.update`)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # None: the plan holds the mask
    *,
    jm_plan: KVPlan | None = None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if jm_plan is None:
        raise RuntimeError("slot_attention runs inside the in-process engine only (no KVPlan was given)")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("slot_attention computes attention without soft-capping")
    window = kwargs.get("sliding_window")  # a key is read only if its position > the query's - window
    plan = jm_plan
    n, heads, q_len, d = query.shape
    kv_heads = key.shape[1]
    rep = heads // kv_heads  # query head h reads kv head h // rep (grouped-query attention)
    scale = scaling or d**-0.5
    q = query.float().reshape(n, kv_heads, rep * q_len, d)
    own = (q @ key.float().transpose(-1, -2)).view(n, kv_heads, rep, q_len, -1)
    own_mask = plan.own_mask  # (n, q, kv_len)
    if window:  # positions are the prefix read plus the slot: the same offset for keys and queries
        slots = torch.arange(own_mask.shape[-1], device=own_mask.device)
        own_mask = own_mask & (slots > plan.write_pos[:, :, None] - window)
    own.masked_fill_(~own_mask[:, None, None], float("-inf"))
    own = own.view(n, kv_heads, rep * q_len, -1)
    layer = getattr(module, "layer_idx", 0)
    if plan.prefix_k is None or plan.prefix_v is None or plan.prefix_mask is None:
        probs = torch.softmax(own.mul_(scale), dim=-1)
        out = probs @ value.float()
    else:
        k_pre, v_pre = plan.prefix_k[layer].float(), plan.prefix_v[layer].float()  # (kv heads, P, d)
        p = k_pre.shape[1]
        # every row's queries against the prefix in one product: (kv heads, n * rep * q, P)
        q_pre = q.permute(1, 0, 2, 3).reshape(kv_heads, n * rep * q_len, d)
        pre = torch.bmm(q_pre, k_pre.transpose(1, 2)).view(kv_heads, n, rep * q_len, p).permute(1, 0, 2, 3)
        pre_mask = plan.prefix_mask[:, None]  # (n, 1, P)
        if window:
            used = plan.prefix_mask.sum(-1)  # (n,) prefix tokens each row reads: its first slot's position
            query_pos = used[:, None] + plan.write_pos  # (n, q)
            pre_mask = pre_mask & (torch.arange(p, device=pre_mask.device) > query_pos[:, :, None] - window)
        pre = pre.reshape(n, kv_heads, rep, q_len, p).masked_fill(~pre_mask[:, None, None], float("-inf"))
        pre = pre.reshape(n, kv_heads, rep * q_len, p)
        probs = torch.softmax(torch.cat([pre, own], dim=-1).mul_(scale), dim=-1)
        p_pre = probs[..., :p].permute(1, 0, 2, 3).reshape(kv_heads, n * rep * q_len, p)
        out = torch.bmm(p_pre, v_pre).view(kv_heads, n, rep * q_len, d).permute(1, 0, 2, 3)
        out = out + probs[..., p:] @ value.float()
    out = out.reshape(n, heads, q_len, d).transpose(1, 2)  # (n, q, heads, d)
    return out.to(query.dtype), None


def register_slot_attention() -> str:
    """Make `slot_attention` known to transformers as `SLOT_ATTENTION` (once), with no mask function:
    the model then builds no attention mask, and the plan's is used."""
    if ALL_ATTENTION_FUNCTIONS.get(SLOT_ATTENTION) is not slot_attention:
        AttentionInterface.register(SLOT_ATTENTION, slot_attention)
    return SLOT_ATTENTION


@contextlib.contextmanager
def slot_attention_on(causal_lm: Any) -> Iterator[None]:
    """The model's attention is `slot_attention` for the block."""
    with attention_implementation(causal_lm, register_slot_attention()):
        yield
