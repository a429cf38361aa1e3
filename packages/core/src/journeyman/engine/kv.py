"""The in-process engine's KV memory: a pool of row slots, the prompt prefix that rows share, and a
cache of finished turns' KV that later turns extend.

- `SlotPool`: per layer, keys and values of shape (slots, kv heads, capacity, head dim). The batch's
  row i lives in slot i from its first token to its last, so a row joins between two decode steps
  by writing into the next free slot, with no other row moved; rows that leave are compacted away
  (the rows after them move down, their filled slots only). Positions are the row's own (RoPE is
  applied before caching), so nothing is ever re-aligned.
- `SharedPrefix`: the keys and values of one prompt prefix (system prompt, tool definitions) at
  batch 1; each row reads its first `p` tokens once per step for the whole batch
  (`slot_attention`), so 32 rows after a 570-token prefix read it once, not 32 times.
- `PrefixCache`: the KV of finished turns (prompt + sampled tokens), under a byte bound with
  least-recently-used eviction. An agent's turn k+1 starts with turn k's prompt and answer, so its
  prefill runs only the tool result and what follows; GRPO rows of one prompt hit each other too.

All of it holds for one version of a model's weights (`LoraPolicy.version`): a training step
empties that model's part. With several models on the engine (`tenants`), each entry is one model's.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["KVPlan", "PrefixCache", "PrefixEntry", "SharedPrefix", "SlotPool"]

BUCKET = 64  # attended lengths and capacities are rounded up to this: fewer shapes per decode step
_HASH_STEP = 64  # a cached turn is findable by any prefix of it at these lengths (and its full one)


def bucket(n: int) -> int:
    return -(-n // BUCKET) * BUCKET


@dataclass
class KVPlan:
    """What one forward pass reads and writes, set before the call and read by `SlotPool.update`
    and `slot_attention` (passed down the model as the `jm_plan` keyword).

    own_k / own_v: per layer, (n, kv heads, capacity, d): the slots of the n rows in this pass (or
    the prefix's buffer when the prefix itself is extended). write_pos (n, q): the slot each query
    token's keys go to. own_mask (n, q, kv_len): which of the first kv_len slots each query attends.
    prefix_k / prefix_v: per layer (kv heads, P, d) of the shared prefix, with prefix_mask (n, P),
    the part of it each row reads; None when no row reads one."""

    own_k: list[torch.Tensor]
    own_v: list[torch.Tensor]
    write_pos: torch.Tensor
    kv_len: int
    own_mask: torch.Tensor
    prefix_k: list[torch.Tensor] | None = None
    prefix_v: list[torch.Tensor] | None = None
    prefix_mask: torch.Tensor | None = None

    @classmethod
    def causal(
        cls, own_k: list[torch.Tensor], own_v: list[torch.Tensor], write_pos: torch.Tensor, last: int
    ) -> KVPlan:
        """A plan whose queries each read every slot up to their own (`last`: the highest of
        `write_pos`, known on the host), over the first `bucket(last + 1)` slots."""
        kv_len = bucket(last + 1)
        mask = torch.arange(kv_len, device=write_pos.device) <= write_pos[:, :, None]
        return cls(own_k, own_v, write_pos, kv_len, mask)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformers `Cache.update` call: the new keys and values (n, kv heads, q, d) go to
        their slots; returned are the attended slots (n, kv heads, kv_len, d), views, not copies."""
        k, v = self.own_k[layer_idx], self.own_v[layer_idx]
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        k[rows, :, self.write_pos] = key.transpose(1, 2).to(k.dtype)  # (n, q, kv heads, d)
        v[rows, :, self.write_pos] = value.transpose(1, 2).to(v.dtype)
        return k[:, :, : self.kv_len], v[:, :, : self.kv_len]

    # transformers reads these of a cache it is handed; the plan's own mask makes them moot
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    @property
    def is_compileable(self) -> bool:
        return False


class _Buffers:
    """Per-layer keys and values of shape (rows, kv heads, capacity, d), grown by copying."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape = (kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k = [self._empty(0, 0) for _ in range(layers)]
        self.v = [self._empty(0, 0) for _ in range(layers)]

    def _empty(self, rows: int, capacity: int) -> torch.Tensor:
        kv_heads, d = self.shape
        return torch.zeros((rows, kv_heads, capacity, d), dtype=self.dtype, device=self.device)

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def reserve(self, rows: int, capacity: int) -> None:
        """At least `rows` x `capacity` slots, the filled ones kept (grown by half again at least, so
        growth is amortised)."""
        old_rows, old_cap = self.rows, self.capacity
        if rows <= old_rows and capacity <= old_cap:
            return
        new_rows = max(rows, old_rows + old_rows // 2) if rows > old_rows else old_rows
        new_cap = bucket(max(capacity, old_cap + old_cap // 2)) if capacity > old_cap else old_cap
        for cache in (self.k, self.v):
            for i, old in enumerate(cache):
                new = self._empty(new_rows, new_cap)
                new[:old_rows, :, :old_cap] = old
                cache[i] = new

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class SlotPool(_Buffers):
    """The slots of the batch's rows (see the module's docstring)."""

    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot `src`'s first `length` slots into slot `dst`."""
        if src == dst or not length:
            return
        for cache in (self.k, self.v):
            for t in cache:
                t[dst, :, :length] = t[src, :, :length]

    def swap(self, a: int, la: int, b: int, lb: int) -> None:
        """Exchange slots `a` (filled to `la`) and `b` (filled to `lb`)."""
        if a == b:
            return
        for cache in (self.k, self.v):
            for t in cache:
                held = t[a, :, :la].clone()
                t[a, :, :lb] = t[b, :, :lb]
                t[b, :, :la] = held

    def read(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of slot `slot`'s first `length` keys and values, per layer (kv heads, length, d)."""
        return [
            (k[slot, :, :length].clone(), v[slot, :, :length].clone())
            for k, v in zip(self.k, self.v, strict=True)
        ]

    def write(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """The first `length` of `kv` (from `read`) into slot `slot`'s first slots."""
        for (k, v), (sk, sv) in zip(kv, zip(self.k, self.v, strict=True), strict=True):
            sk[slot, :, :length] = k[:, :length]
            sv[slot, :, :length] = v[:, :length]

    def rows_view(self, start: int, stop: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [k[start:stop] for k in self.k], [v[start:stop] for v in self.v]


class SharedPrefix(_Buffers):
    """One prompt prefix's keys and values at batch 1 (see the module's docstring)."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(layers, kv_heads, head_dim, dtype, device)
        self.tokens: tuple[int, ...] = ()
        self.owner = 0  # the model whose weights computed it (`tenants`)
        self.version = -1  # the version of those weights

    def clear(self, version: int, owner: int = 0) -> None:
        self.tokens, self.version, self.owner = (), version, owner

    def per_layer(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer (kv heads, P, d) views of the prefix's keys and values."""
        p = len(self.tokens)
        return [k[0, :, :p] for k in self.k], [v[0, :, :p] for v in self.v]


@dataclass(eq=False)
class PrefixEntry:
    """A finished turn's KV: `tokens` (the prompt and every sampled token but the last), of which the
    first `prefix` were read from the shared prefix and the rest are in `kv`."""

    tokens: tuple[int, ...]
    prefix: int
    prefix_tokens: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (kv heads, len(tokens) - prefix, d)
    tenant: int = 0  # the model whose weights computed it: found by its rows alone
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)


class PrefixCache:
    """Finished turns' KV, found by the longest cached prefix of a new prompt (see the module's
    docstring); at most `max_bytes`, least recently used evicted first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.versions: dict[int, int] = {}  # each model's weights' version its entries were computed under
        self._entries: collections.OrderedDict[int, PrefixEntry] = (
            collections.OrderedDict()
        )  # by id, LRU first
        self._by_hash: dict[
            tuple[int, int, int], PrefixEntry
        ] = {}  # (model, length, hash of tokens[:length])
        self.hits = 0  # prompts that found a cached prefix
        self.tokens_reused = 0  # prompt tokens whose prefill a cached prefix spared
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self, version: int, tenant: int = 0) -> None:
        """Drop model `tenant`'s entries: its weights are now of `version`."""
        for entry in [e for e in self._entries.values() if e.tenant == tenant]:
            del self._entries[id(entry)]
            self._drop(entry)
        self.versions[tenant] = version

    def refresh(self, versions: Sequence[int]) -> None:
        """Drop the entries of every model whose weights changed (`versions`, by model index)."""
        for tenant, version in enumerate(versions):
            if self.versions.get(tenant) != version:
                self.clear(version, tenant)

    def put(self, entry: PrefixEntry) -> None:
        if entry.nbytes > self.max_bytes or len(entry.tokens) - entry.prefix < 1:
            return
        self._entries[id(entry)] = entry
        self.nbytes += entry.nbytes
        for length in (*range(_HASH_STEP, len(entry.tokens), _HASH_STEP), len(entry.tokens)):
            self._by_hash[(entry.tenant, length, hash(entry.tokens[:length]))] = entry  # the newest wins
        while self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._drop(old)
            self.evictions += 1

    def _drop(self, entry: PrefixEntry) -> None:
        self.nbytes -= entry.nbytes
        for length in (*range(_HASH_STEP, len(entry.tokens), _HASH_STEP), len(entry.tokens)):
            key = (entry.tenant, length, hash(entry.tokens[:length]))
            if self._by_hash.get(key) is entry:
                del self._by_hash[key]

    def find(self, prompt: tuple[int, ...], limit: int, tenant: int = 0) -> tuple[PrefixEntry, int] | None:
        """Model `tenant`'s cached entry sharing the longest prefix with `prompt` (at most `limit`
        tokens of it), and that length; None when none shares more than its shared-prefix part."""
        if not self._entries:
            return None
        lengths = sorted({k[1] for k in self._by_hash if k[1] <= limit and k[0] == tenant}, reverse=True)
        for length in lengths:
            entry = self._by_hash.get((tenant, length, hash(prompt[:length])))
            if entry is not None and entry.tokens[:length] == prompt[:length] and length > entry.prefix:
                self._entries.move_to_end(id(entry))
                return entry, length
        return None
