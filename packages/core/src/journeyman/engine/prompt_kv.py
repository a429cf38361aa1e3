"""Where a row's prompt keys and values come from before its prefill (`batch`): the part a shared
prompt prefix covers (system prompt, tool definitions: ~570 of ~600 tokens on an MCP server) is read
from `SharedPrefix` by every row at once, and the part an earlier turn covers (an agent's turn k+1
extends turn k's prompt and answer) is copied from `PrefixCache`. Only the rest is prefilled.

Keys and values are a model's: with several models on the engine (`tenants`), a cached turn is
found by rows of its own model alone, and the shared prefix is the model's that computed it last
(rows of the others prefill the part it would have spared them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from journeyman.data.prefix import MIN_SHARED_PREFIX, common_prefix_length
from journeyman.engine.kv import KVPlan, PrefixCache, PrefixEntry, SharedPrefix, SlotPool
from journeyman.engine.rows import Row

__all__ = ["PromptKV", "RunModel"]

# the decoder's last hidden states (n, q, hidden) for ids (n, q) at positions (n, q) under a plan,
# each row through the adapter of the model it names (a model index a row)
RunModel = Callable[[torch.Tensor, torch.Tensor, KVPlan, list[int]], torch.Tensor]


class PromptKV:
    """The shared prefix and the cache of earlier turns, for one version of each model's weights."""

    def __init__(
        self, layout: tuple[int, int, int, torch.dtype, torch.device], cache_bytes: int, run: RunModel
    ) -> None:
        self.shared = SharedPrefix(*layout)
        self.cache = PrefixCache(cache_bytes)
        self._device = layout[4]
        self._run = run
        self.computes = 0  # times the shared prefix was computed or extended
        self.tokens_saved = 0  # prompt tokens read from the shared prefix instead of prefilled
        self._versions: list[int] = [0]

    def refresh(self, versions: Sequence[int]) -> None:
        """Drop keys and values computed under weights older than `versions` (a model's, by index)."""
        self._versions = list(versions)
        self.cache.refresh(self._versions)
        owner = self.shared.owner
        if owner >= len(versions) or self.shared.version != versions[owner]:
            self.shared.clear(versions[0])

    def _mine(self, tenant: int) -> tuple[int, ...]:
        """The shared prefix's tokens if it is `tenant`'s, else none."""
        return self.shared.tokens if self.shared.owner == tenant else ()

    def extend(
        self, prompts: list[tuple[int, ...]], held: Sequence[Row[Any]], chunk: int, tenant: int = 0
    ) -> int:
        """Compute (or extend) the shared prefix to what `prompts` share, when that is more than it and
        a cached earlier turn cover, by at least `MIN_SHARED_PREFIX` tokens; returns the tokens
        prefilled. Each prompt keeps at least one token of its own, whose logits start its sampling.
        The prefix is replaced only while none of the `held` rows reads it. `prompts` are model
        `tenant`'s: the prefix becomes its."""
        want = common_prefix_length(prompts, min(len(p) for p in prompts) - 1)
        tokens = self._mine(tenant)
        have = common_prefix_length([tokens, prompts[0]], min(len(tokens), want))
        hit = self.cache.find(prompts[0], want, tenant) if len(prompts) == 1 else None
        if want - max(have, hit[1] if hit else 0) < MIN_SHARED_PREFIX:
            return 0
        if have < len(self.shared.tokens) and any(r.prefix > have for r in held):
            return 0  # another prefix (or another model's), still read by running rows
        self._prefill(prompts[0][:want], have, chunk, tenant)
        return want - have

    def _prefill(self, tokens: tuple[int, ...], start: int, chunk: int, tenant: int) -> None:
        """Run `tokens[start:]` at batch 1 after the shared prefix's first `start`, in chunks."""
        self.shared.reserve(1, len(tokens))
        self.shared.tokens = tokens[:start]
        self.shared.owner, self.shared.version = tenant, self._versions[tenant]
        step = max(1, chunk)
        for lo in range(start, len(tokens), step):
            hi = min(len(tokens), lo + step)
            write = torch.arange(lo, hi, device=self._device)[None]
            plan = KVPlan.causal(self.shared.k, self.shared.v, write, hi - 1)
            self._run(torch.tensor([tokens[lo:hi]], device=self._device), write, plan, [tenant])
            self.shared.tokens = tokens[:hi]
        self.computes += 1

    def place(self, row: Row[Any], slot: int, pool: SlotPool) -> None:
        """Put what is already computed of `row`'s prompt in its slot: a cached earlier turn's keys and
        values, or else the shared prefix's part; the rest is pending."""
        prompt = tuple(row.prompt)
        tokens = self._mine(row.tenant)
        shared = common_prefix_length([prompt, tokens], len(prompt) - 1)
        hit = self.cache.find(prompt, len(prompt) - 1, row.tenant)
        if hit is not None and hit[1] > shared:
            entry, length = hit
            if tokens[: entry.prefix] == entry.prefix_tokens:
                row.prefix, row.length = entry.prefix, length - entry.prefix
                pool.reserve(0, row.length)
                pool.write(slot, entry.kv, row.length)
                row.pending = list(prompt[length:])
                self.cache.hits += 1
                self.cache.tokens_reused += row.length
                self.tokens_saved += row.prefix
                return
        row.prefix = shared if shared >= MIN_SHARED_PREFIX else 0
        row.length = 0
        row.pending = list(prompt[row.prefix :])
        self.tokens_saved += row.prefix

    def remember(self, row: Row[Any], slot: int, pool: SlotPool) -> None:
        """A finished row's keys and values, for a later turn that extends its prompt and answer."""
        if row.length < 1:
            return
        tokens = (*row.prompt, *row.tokens[:-1])
        self.cache.put(
            PrefixEntry(
                tokens, row.prefix, self.shared.tokens[: row.prefix], pool.read(slot, row.length), row.tenant
            )
        )

    def attach(self, plan: KVPlan, rows: Sequence[Row[Any]]) -> None:
        """Let `plan` read the shared prefix, as far as each of `rows` uses it."""
        p = max(r.prefix for r in rows)
        if not p:
            return
        k, v = self.shared.per_layer()
        plan.prefix_k, plan.prefix_v = [t[:, :p] for t in k], [t[:, :p] for t in v]
        prefixes = torch.tensor([r.prefix for r in rows], device=self._device)
        plan.prefix_mask = torch.arange(p, device=self._device) < prefixes[:, None]
