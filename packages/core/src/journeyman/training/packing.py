"""Rows into micro-batches, and the forward pass that gives their trained tokens' logprobs.

A micro-batch is one packed sequence (`pack_rows`): rows sorted by their token ids and laid end to
end, each after the longest prefix it shares with the row before it, which is already in the
sequence. Every token sees the tokens of its own row up to itself, whether its row put them there or
an earlier row did, so a row's hidden states, logprobs and gradients are those of the row run alone
(test_train_step.py, test_packed_attention.py), with no padding and each shared prompt prefix run once
per micro-batch: the step-wide system prompt and tool definitions of agent rows (~570 of ~700
tokens on an MCP server), and also the prompt the rows of one group share.

`pack_tree` goes one further: a prompt prefix that rows share (at least `MIN_SHARED_PREFIX` tokens
beyond the shorter prefix it extends, short of any row's first trained token) is run once per
step, on its own, before the micro-batches: a `SharedPrefix`, whose keys and values at every layer
the micro-batches of its rows attend to. They attend to copies detached from its graph, which
gather the gradient the micro-batches send back; `PrefixTree.backward` then sends it through the
prefix's own forward once, children before parents (a group's prompt extends the system prompt),
so the LoRA gradient is that of running the prefix in every row. The micro-batches hold only what
comes after each row's prefix, so at the default 1024-token budget an agent step no longer runs its
system prompt and tools once per micro-batch.

Attention over a packed sequence (`packed_attention`) builds no (L, L) mask: a key k is seen by the
queries at places [lo[k], hi[k]) of the sequence (a key of the sequence from its own place to the end
of the last row that holds it; a prefix's key by the spans of the rows under it), so a pack is
described by two integers per key. The default ("rows", every device) runs each row's queries
against its own keys through the model's attention function (SDPA; FlashAttention on CUDA), causal
without a mask where the row has nothing before its span, else with a mask of the row's own size,
in chunks of queries for long rows (a padded single call would run every row's queries against the
longest row's keys). "flex", opt-in, is one FlexAttention call per layer with the layout's block
mask: compiled, it recompiles for every new pack length and, past torch's recompile limit, falls
back to an unfused kernel (on an H200, a 4096-token pack with a shared prefix ran forward and
backward in 3.1 s on it, 0.63 s on "rows"; docs/scale.md); on the CPU it has no backward and runs
its unfused reference, without grad, to check a layout. The dense (1, 1, L, L) mask with `row_attention`
("dense", `packed_attention_mask`) and the padded path (`pad_rows`, `trained_logprobs`: a prefix
common to every row of a batch run once and its keys and values expanded to the batch) are kept as
references, the padded one also for SFT with packing off.

Both attention functions reach transformers through its `AttentionInterface` registry; they are
registered when first used (`register_row_attention`, `register_packed_attention`), never on import.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, NamedTuple, get_args

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from journeyman.data.prefix import MIN_SHARED_PREFIX, common_prefix_length
from journeyman.errors import InvalidFieldError
from journeyman.policy.lora import attention_implementation, cache_kv
from journeyman.training.loss import head_logprobs
from journeyman.training.rows import Row

__all__ = [
    "PACKED_ATTENTION",
    "ROW_ATTENTION",
    "Pack",
    "PackAttention",
    "PackLayout",
    "PackedInputs",
    "PrefixTree",
    "SharedPrefix",
    "micro_batches",
    "pack_rows",
    "pack_tree",
    "packed_attention",
    "packed_attention_mask",
    "packed_logprobs",
    "pad_rows",
    "register_packed_attention",
    "register_row_attention",
    "row_attention",
    "shared_prefix_length",
    "trained_logprobs",
]

# "auto": "rows" ("flex" is opt-in: see the module's docstring); "dense": the reference, a
# (1, 1, L, L) mask (no prefixes)
PackAttention = Literal["auto", "flex", "rows", "dense"]


def shared_prefix_length(rows: Sequence[Row]) -> int:
    """Tokens every row starts with, short of the position that predicts any row's first trained
    token; 0 when fewer than `MIN_SHARED_PREFIX`."""
    limit = min((r.trained.index(True) if True in r.trained else len(r.input_ids)) - 1 for r in rows)
    n = common_prefix_length([r.input_ids for r in rows], limit)
    return n if n >= MIN_SHARED_PREFIX else 0


def micro_batches(rows: list[Row], budget: int, shared: int = 0) -> Iterator[list[Row]]:
    """Length-sorted batches whose padded size, beyond the `shared` prefix, stays under `budget` tokens."""
    batch: list[Row] = []
    width = 0
    for r in sorted(rows, key=lambda r: len(r.input_ids)):
        w = max(width, len(r.input_ids) - shared)
        if batch and w * (len(batch) + 1) > budget:
            yield batch
            batch, w = [], len(r.input_ids) - shared
        batch.append(r)
        width = w
    if batch:
        yield batch


@dataclass(eq=False)
class SharedPrefix:
    """A prompt prefix that several rows of a step start with, run once per step (`pack_tree`):
    tokens [start, end) of each of its rows, after its parent's [0, start)."""

    ids: list[int]
    start: int
    parent: SharedPrefix | None = None
    # one forward per mode it is run in (grad or not, adapter on or off, autocast): `_PrefixRun`
    runs: dict[tuple[object, ...], _PrefixRun] = field(default_factory=dict, repr=False)

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    def chain(self) -> list[SharedPrefix]:
        """Its ancestors, root first, then itself: what a row under it starts with, in order."""
        out: list[SharedPrefix] = []
        node: SharedPrefix | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


@dataclass
class _PrefixRun:
    """A prefix's keys and values at every layer, from one forward of it. In a forward with grad,
    what the micro-batches read are leaves detached from that forward (`keys`, `values`): their
    `.grad` gathers what every micro-batch sends back, and `PrefixTree.backward` sends the sum
    through the forward (`sources`) once."""

    grad: bool
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    sources: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        # the first forward only: a checkpointed layer's recompute (in the backward) calls again
        if layer in self.keys:
            return
        if self.grad:
            self.sources += [(key, self.keys.setdefault(layer, key.detach().requires_grad_()))]
            self.sources += [(value, self.values.setdefault(layer, value.detach().requires_grad_()))]
        else:
            self.keys[layer], self.values[layer] = key.detach(), value.detach()

    def backward(self) -> None:
        pairs = [(t, leaf.grad) for t, leaf in self.sources if leaf.grad is not None and t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


@dataclass
class Pack:
    """Rows run as one sequence, each after the prefix it shares with the row before it (`pack_rows`),
    or after its `SharedPrefix`, run on its own (`pack_tree`)."""

    rows: list[Row] = field(default_factory=list)
    # per row, the place in the sequence of each of its tokens: a shared prefix's places are the
    # places the row before it gave that prefix; -1 for the tokens of the row's `SharedPrefix`
    places: list[list[int]] = field(default_factory=list)
    # per row, the span [start, end) of the sequence its own tokens (past the shared prefix) fill
    spans: list[tuple[int, int]] = field(default_factory=list)
    length: int = 0
    # per row, the deepest `SharedPrefix` it starts with (None: it starts in the sequence)
    prefixes: list[SharedPrefix | None] = field(default_factory=list)
    attention: PackAttention = "auto"

    def add(self, row: Row, shared: int, prefix: SharedPrefix | None = None) -> None:
        """Append `row`, of which the first `shared` tokens are already there: the tokens of its
        `prefix`, then those it shares with the last row added (which ends the same prefix)."""
        n, start = len(row.input_ids), prefix.end if prefix is not None else 0
        head = [-1] * start + (self.places[-1][start:shared] if shared > start else [])
        self.places.append(head + list(range(self.length, self.length + n - shared)))
        self.spans.append((self.length, self.length + n - shared))
        self.rows.append(row)
        self.prefixes.append(prefix)
        self.length += n - shared

    def inputs(self, device: torch.device) -> PackedInputs:
        """The sequence as model inputs for `self.attention`; the attention lets a token see the
        tokens of its row up to itself, no other row's, so a row packed here gives the logprobs it
        gives alone."""
        return PackedInputs(self, device)


class PackedInputs:
    """A pack as tensors on `device`. What only one attention needs is built when first read: the
    dense mask and per-row spans (the "dense" reference), the key intervals (`layout`)."""

    def __init__(self, pack: Pack, device: torch.device) -> None:
        self.pack, self.device = pack, device
        attention = pack.attention
        if attention == "auto":
            attention = "rows"
        if attention not in get_args(PackAttention):
            raise InvalidFieldError("attention", attention, f"one of {get_args(PackAttention)}")
        if attention == "dense" and any(p is not None for p in pack.prefixes):
            raise InvalidFieldError(
                "attention", attention, "the dense reference runs packs without shared prefixes (pack_rows)"
            )
        self.attention: PackAttention = attention
        ids = torch.zeros(pack.length, dtype=torch.long)
        positions = torch.zeros(pack.length, dtype=torch.long)
        places = torch.zeros((len(pack.rows), max(len(p) for p in pack.places)), dtype=torch.long)
        for b, (row, where) in enumerate(zip(pack.rows, pack.places, strict=True)):
            at = torch.tensor(where)
            here = at >= 0  # not in the row's SharedPrefix
            ids[at[here]] = torch.tensor(row.input_ids)[here]
            positions[at[here]] = torch.arange(len(where))[here]
            places[b, : len(where)] = at.clamp(min=0)
        self.ids = ids[None].to(device)  # (1, L)
        self.positions = positions[None].to(device)  # (1, L) each token's position in its row
        # (B, T) where row b's token t sits in the sequence (0 past the row's end and in its prefix)
        self.places = places.to(device)

    @cached_property
    def mask(self) -> torch.Tensor:
        """(1, 1, L, L), True where a token may attend: the dense reference."""
        mask = torch.zeros((self.pack.length, self.pack.length), dtype=torch.bool)
        for where in self.pack.places:
            at = torch.tensor(where)
            # a shared token gets the same mask row from every row that holds it: the shared prefix
            mask[at[:, None], at] = torch.ones((len(where), len(where)), dtype=torch.bool).tril()
        return mask[None, None].to(self.device)

    @cached_property
    def spans(self) -> list[tuple[int, int, torch.Tensor]]:
        """Per row, (start, end, places): the span of the sequence it put there, and the places of
        all its tokens (shared prefix included), the keys its span's queries attend to (`row_attention`)."""
        return [
            (start, end, torch.tensor(where, device=self.device))
            for (start, end), where in zip(self.pack.spans, self.pack.places, strict=True)
        ]

    @cached_property
    def layout(self) -> PackLayout:
        return PackLayout.of(self.pack, self.positions[0], "flex" if self.attention == "flex" else "rows")


def pack_rows(rows: Sequence[Row], budget: int, attention: PackAttention = "auto") -> list[Pack]:
    """Rows into sequences of at most `budget` tokens (a longer row alone), each row after the
    longest prefix it shares with the row before it in its sequence.

    Sorted by token ids, a row's longest common prefix with any earlier row is the one with the row
    just before it, so filling sequences in that order puts every shared prefix in once per
    sequence; rows of one group (one prompt) sit side by side."""
    packs: list[Pack] = []
    for row in sorted(rows, key=lambda r: r.input_ids):
        n = len(row.input_ids)
        last = packs[-1] if packs else None
        shared = common_prefix_length([last.rows[-1].input_ids, row.input_ids], n) if last else 0
        if last is None or last.length + n - shared > budget:
            last, shared = Pack(attention=attention), 0
            packs.append(last)
        last.add(row, shared)
    return packs


@dataclass
class PrefixTree:
    """A step's micro-batches and the prompt prefixes they share, each run once (`pack_tree`).

    After every micro-batch's backward, `backward()` adds the prefixes' share of the gradient."""

    packs: list[Pack]
    prefixes: list[SharedPrefix]  # parents before children

    @property
    def forward_tokens(self) -> int:
        """Token positions one forward of the step runs: the packs' and each prefix's once."""
        return sum(p.length for p in self.packs) + sum(len(p.ids) for p in self.prefixes)

    def backward(self) -> None:
        """The gradient the micro-batches sent to each prefix's keys and values, through the
        prefix's forward, children first (theirs reaches their parent's); then the prefixes' runs
        are dropped, so the next step runs them afresh."""
        for prefix in reversed(self.prefixes):
            for run in prefix.runs.values():
                run.backward()
            prefix.runs.clear()


def _untrained_prefix(row: Row) -> int:
    """Tokens a shared prefix may take from `row`: short of the position that predicts its first
    trained token, whose hidden state the loss needs."""
    return max(0, (row.trained.index(True) if True in row.trained else len(row.input_ids)) - 1)


def _shared_prefixes(order: Sequence[Row]) -> tuple[list[SharedPrefix], list[SharedPrefix | None]]:
    """The prompt prefixes rows sorted by ids share (parents first), and each row's deepest one.

    The prefixes are the nodes of the rows' prefix tree (cut before each row's trained tokens):
    the maximal runs of sorted rows whose common prefix is longer than that of any wider run (the
    LCP intervals of a suffix array, found with one stack). One becomes a `SharedPrefix` when it
    adds at least `MIN_SHARED_PREFIX` tokens to the prefix it extends."""
    n = len(order)
    limit = [_untrained_prefix(r) for r in order]
    lcp = [0] * (n + 1)  # lcp[i]: rows i-1 and i; lcp[n] = 0 closes every run
    for i in range(1, n):
        lcp[i] = common_prefix_length(
            [order[i - 1].input_ids, order[i].input_ids], min(limit[i - 1], limit[i])
        )
    runs: list[tuple[int, int, int]] = []  # (common prefix, first row, last row)
    stack = [(0, 0)]  # open runs: (common prefix, first row)
    for i in range(1, n + 1):
        first = i - 1
        while lcp[i] < stack[-1][0]:
            length, first = stack.pop()
            runs.append((length, first, i - 1))
        if lcp[i] > stack[-1][0]:
            stack.append((lcp[i], first))
    prefixes: list[SharedPrefix] = []
    deepest: list[SharedPrefix | None] = [None] * n
    open_: list[tuple[SharedPrefix, int]] = []  # chosen prefixes holding the current run, with their last row
    for length, first, last in sorted(runs, key=lambda r: (r[1], -r[2])):  # outer runs before inner
        while open_ and open_[-1][1] < first:
            open_.pop()
        parent = open_[-1][0] if open_ else None
        start = parent.end if parent is not None else 0
        if length - start < MIN_SHARED_PREFIX:
            continue
        prefix = SharedPrefix(list(order[first].input_ids[start:length]), start, parent)
        prefixes.append(prefix)
        open_.append((prefix, last))
        deepest[first : last + 1] = [prefix] * (last - first + 1)
    return prefixes, deepest


def pack_tree(rows: Sequence[Row], budget: int, attention: PackAttention = "auto") -> PrefixTree:
    """Rows into sequences of at most `budget` tokens of their own (a longer row alone), the
    prompt prefixes they share taken out and run once for the step (`SharedPrefix`).

    Sorted by token ids as in `pack_rows`; a row starts after its deepest prefix, and after what it
    shares beyond it with the row before it when that row ends the same prefix (a trained turn that
    rows share, a prefix too short to run on its own)."""
    order = sorted(rows, key=lambda r: r.input_ids)
    prefixes, deepest = _shared_prefixes(order)
    packs: list[Pack] = []
    for row, prefix in zip(order, deepest, strict=True):
        n, start = len(row.input_ids), prefix.end if prefix is not None else 0
        last = packs[-1] if packs else None
        shared = start
        if last is not None and last.prefixes[-1] is prefix:
            shared = max(start, common_prefix_length([last.rows[-1].input_ids, row.input_ids], n))
        if last is None or last.length + n - shared > budget:
            last, shared = Pack(attention=attention), start
            packs.append(last)
        last.add(row, shared, prefix)
    return PrefixTree(packs, prefixes)


def packed_attention_mask(
    config: Any, inputs: PackedInputs, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask `packed_logprobs` hands the model. A model with sliding-window layers (Gemma 3,
    Mistral) builds its window into the masks it makes itself, and uses a given mask as is, so the
    window goes into ours: a token sees its row's last `sliding_window` positions only. Models that
    mix full and sliding layers take one mask per layer type."""
    mask = inputs.mask
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    sliding = None
    if window and ("sliding_attention" in layer_types or not layer_types):
        pos = inputs.positions[0]
        sliding = mask & ((pos[:, None] - pos[None, :]) < window)[None, None]
    if config._attn_implementation != "sdpa":  # additive masks
        mask, sliding = (
            None
            if m is None
            else torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
            for m in (mask, sliding)
        )
    assert mask is not None
    if sliding is None:
        return mask
    if not layer_types:  # every layer slides (Mistral with `sliding_window` set)
        return sliding
    return {"full_attention": mask, "sliding_attention": sliding}


ROW_ATTENTION = "journeyman_rows"


def row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    pack_spans: list[tuple[int, int, torch.Tensor]],
    pack_attention: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed sequence one row at a time: the queries of a row's own span against
    the keys of that row's tokens only, through the model's own attention function (`pack_attention`)
    with the matching block of the packed mask (causal, sliding window). The same numbers as the
    whole (L, L) masked product, for the sum over rows of span x row length instead of L².

    Every row's keys and values are gathered in one index and cut apart with `split`, and the
    queries split by span (the spans tile the sequence in order): the backward of that is one
    concatenation and one scatter-add, where indexing row by row gave each row's gradient the shape
    of the whole sequence, zero-filled and added up."""
    inner = ALL_ATTENTION_FUNCTIONS[pack_attention]
    places = torch.cat([keys for _, _, keys in pack_spans])  # (sum of row lengths,)
    lengths = [len(keys) for _, _, keys in pack_spans]
    row_keys = key[:, :, places].split(lengths, dim=2)
    row_values = value[:, :, places].split(lengths, dim=2)
    row_queries = query.split([end - start for start, end, _ in pack_spans], dim=2)
    outs = []
    for (start, end, keys), q, k, v in zip(pack_spans, row_queries, row_keys, row_values, strict=True):
        if start == end:  # a row the one before it holds whole (the same sample twice)
            continue
        mask = None if attention_mask is None else attention_mask[:, :, start:end][..., keys]
        out, _ = inner(module, q, k, v, mask, **kwargs)
        outs.append(out)  # (1, span, heads, head dim)
    return torch.cat(outs, dim=1), None


def register_row_attention() -> str:
    """Make `row_attention` known to transformers as `ROW_ATTENTION` (once; later calls change
    nothing); returns the name to set as a model's attention implementation."""
    if ALL_ATTENTION_FUNCTIONS.get(ROW_ATTENTION) is not row_attention:
        AttentionInterface.register(ROW_ATTENTION, row_attention)
    return ROW_ATTENTION


@dataclass(eq=False)
class PackLayout:
    """Which keys each query of a packed sequence sees, in O(keys) integers: the keys are the
    sequence's own after those of the `SharedPrefix`es its rows start with (`prefixes`, in this
    order), and the queries at places [lo[k], hi[k]) see key k (`packed_attention`)."""

    kernel: Literal["flex", "rows"]
    prefixes: list[SharedPrefix]
    lo: torch.Tensor  # (K,) K = the prefixes' tokens + L
    hi: torch.Tensor  # (K,)
    key_positions: torch.Tensor  # (K,) each key's position in its rows
    query_positions: torch.Tensor  # (L,)
    # "rows": each row's keys in position order (indices into the K keys), concatenated; the rows'
    # key counts and span lengths, rows with an empty span (a twin of the row before) left out
    row_keys: torch.Tensor
    row_lengths: list[int]
    span_lengths: list[int]
    _block_masks: dict[int | None, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, pack: Pack, positions: torch.Tensor, kernel: Literal["flex", "rows"]) -> PackLayout:
        """`positions`: (L,) on the host; the layout's tensors go to its device."""
        device = positions.device
        positions = positions.cpu()
        prefixes: list[SharedPrefix] = []
        lo_of: dict[int, int] = {}
        hi_of: dict[int, int] = {}
        for (start, end), deepest in zip(pack.spans, pack.prefixes, strict=True):
            for node in deepest.chain() if deepest is not None else []:
                if id(node) not in lo_of:  # rows under one prefix sit side by side: one range
                    prefixes.append(node)
                    lo_of[id(node)] = start
                hi_of[id(node)] = end
        offsets = [0]
        for node in prefixes:
            offsets.append(offsets[-1] + len(node.ids))
        before, length = offsets[-1], pack.length
        held = [torch.tensor([p for p in where if p >= 0], dtype=torch.long) for where in pack.places]
        # a key of the sequence is seen from its own place to the end of the last row holding it
        ends = torch.zeros(length, dtype=torch.long).scatter_reduce(
            0,
            torch.cat(held),
            torch.cat([torch.full((len(h),), end) for h, (_, end) in zip(held, pack.spans, strict=True)]),
            reduce="amax",
        )
        lo = torch.cat([torch.full((len(n.ids),), lo_of[id(n)]) for n in prefixes] + [torch.arange(length)])
        hi = torch.cat([torch.full((len(n.ids),), hi_of[id(n)]) for n in prefixes] + [ends])
        key_positions = torch.cat([torch.arange(n.start, n.end) for n in prefixes] + [positions])
        where = {id(n): torch.arange(offsets[i], offsets[i + 1]) for i, n in enumerate(prefixes)}
        row_keys: list[torch.Tensor] = []
        row_lengths: list[int] = []
        span_lengths: list[int] = []
        for h, (start, end), deepest in zip(held, pack.spans, pack.prefixes, strict=True):
            if start == end:
                continue
            chain = deepest.chain() if deepest is not None else []
            row_keys += [where[id(n)] for n in chain] + [h + before]
            row_lengths.append(sum(len(n.ids) for n in chain) + len(h))
            span_lengths.append(end - start)
        return cls(
            kernel,
            prefixes,
            lo.to(device),
            hi.to(device),
            key_positions.to(device),
            positions.to(device),
            torch.cat(row_keys).to(device),
            row_lengths,
            span_lengths,
        )

    def block_mask(self, window: int | None) -> Any:
        """The FlexAttention `BlockMask` of this layout (one per sliding window), built from the key
        intervals per 128-token block: (L / 128) x K booleans at most, never L x K."""
        if window not in self._block_masks:
            self._block_masks[window] = _flex_block_mask(self, window)
        return self._block_masks[window]


def _flex_block_mask(layout: PackLayout, window: int | None) -> Any:
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as BLOCK
    from torch.nn.attention.flex_attention import BlockMask

    q_len, kv_len = len(layout.query_positions), len(layout.lo)
    nq, nk = -(-q_len // BLOCK), -(-kv_len // BLOCK)
    device = layout.lo.device
    pad_k, pad_q = nk * BLOCK - kv_len, nq * BLOCK - q_len
    # padded to whole blocks, so the mask function never reads past the end; a padded key is seen by no query
    lo = torch.nn.functional.pad(layout.lo, (0, pad_k), value=nq * BLOCK)
    hi = torch.nn.functional.pad(layout.hi, (0, pad_k), value=0)
    kpos = torch.nn.functional.pad(layout.key_positions, (0, pad_k), value=0)
    qpos = torch.nn.functional.pad(layout.query_positions, (0, pad_q), value=0)
    q_start = torch.arange(nq, device=device) * BLOCK
    q_end = (q_start + BLOCK).clamp(max=q_len)
    seen = (lo[None] < q_end[:, None]) & (hi[None] > q_start[:, None])  # (nq, nk * BLOCK)
    partial = seen.view(nq, nk, BLOCK).any(-1)
    full = torch.zeros_like(partial)
    if window is None:  # every key of the block seen by every query of the block: no mask to apply
        full = ((lo[None] <= q_start[:, None]) & (hi[None] >= q_end[:, None])).view(nq, nk, BLOCK).all(-1)
        full &= (q_end - q_start == BLOCK)[:, None]
    partial &= ~full

    def mask_mod(b: Any, h: Any, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        ok = (lo[kv] <= q) & (q < hi[kv])
        if window is not None:
            ok = ok & (qpos[q] - kpos[kv] < window)
        return ok

    def listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (1, 1, nq), (1, 1, nq, nk)
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)  # listed blocks first
        return blocks.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(
        *listed(partial), *listed(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(q_len, kv_len)
    )


PACKED_ATTENTION = "journeyman_packed"
# a chunk of a row's queries gets a mask of at most this many entries (4 MB of booleans)
_ROW_MASK_ELEMENTS = 1 << 22


class _PackCall(NamedTuple):
    layout: PackLayout
    inner: str  # the model's own attention implementation
    runs: list[_PrefixRun]  # of `layout.prefixes`, in the mode of this forward
    capture: _PrefixRun | None  # a prefix's own forward: where its keys and values go


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    pack_call: _PackCall,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed sequence as `PackLayout` describes it: the keys and values of the
    rows' `SharedPrefix`es before the sequence's own, then FlexAttention with the layout's block
    mask in one call ("flex"), or each row's queries against its own keys ("rows")."""
    layout, layer = pack_call.layout, int(module.layer_idx)  # pyright: ignore[reportArgumentType]
    if pack_call.capture is not None:
        pack_call.capture.store(layer, key, value)
    if pack_call.runs:
        key = torch.cat([*(r.keys[layer] for r in pack_call.runs), key], dim=2)
        value = torch.cat([*(r.values[layer] for r in pack_call.runs), value], dim=2)
    if layout.kernel == "flex":
        mask = layout.block_mask(kwargs.get("sliding_window"))
        if query.device.type == "cpu":
            return _flex_reference(query, key, value, mask, kwargs)
        return ALL_ATTENTION_FUNCTIONS["flex_attention"](module, query, key, value, mask, **kwargs)
    return _rows_attention(module, query, key, value, layout, pack_call.inner, kwargs)


def _flex_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, None]:
    """FlexAttention on the CPU, where torch has no backward for it: its unfused reference, which
    checks a layout's block mask without grad. (Compiled for the CPU, torch 2.15 gives wrong numbers
    for rows whose first key blocks are all masked.)"""
    from torch.nn.attention.flex_attention import flex_attention

    softcap: float | None = kwargs.get("softcap")

    def capped(score: torch.Tensor, b: Any, h: Any, q: Any, kv: Any) -> torch.Tensor:
        return score if softcap is None else softcap * torch.tanh(score / softcap)

    out = flex_attention(
        query,
        key,
        value,
        score_mod=capped,
        block_mask=mask,
        scale=kwargs.get("scaling"),
        enable_gqa=key.shape[1] != query.shape[1],
    )
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2).contiguous(), None


def _rows_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: PackLayout,
    inner_name: str,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Each row's span of queries against its own keys, which are its tokens in position order, so
    its span's queries are the last of them: causal from the bottom right. A row with nothing before
    its span runs SDPA's own causal kernel, maskless; otherwise the mask is of the row's size, and a
    long row's queries go in chunks whose masks stay under `_ROW_MASK_ELEMENTS`."""
    inner = ALL_ATTENTION_FUNCTIONS[inner_name]
    window: int | None = kwargs.get("sliding_window")
    sdpa = inner_name == "sdpa"  # the others add a mask to the scores
    row_k = key[:, :, layout.row_keys].split(layout.row_lengths, dim=2)
    row_v = value[:, :, layout.row_keys].split(layout.row_lengths, dim=2)
    row_q = query.split(layout.span_lengths, dim=2)
    outs: list[torch.Tensor] = []
    for q, k, v in zip(row_q, row_k, row_v, strict=True):
        span, n = q.shape[2], k.shape[2]
        before = n - span
        if before == 0 and window is None and sdpa:
            outs.append(inner(module, q, k, v, None, **kwargs)[0])  # (1, span, heads, head dim)
            continue
        step = max(1, _ROW_MASK_ELEMENTS // n)
        for a in range(0, span, step):
            b = min(span, a + step)
            first = (
                0 if window is None else max(0, before + a - window + 1)
            )  # keys no query here sees dropped
            qi = torch.arange(before + a, before + b, device=q.device)[:, None]
            ki = torch.arange(first, before + b, device=q.device)[None]
            mask = ki <= qi
            if window is not None:
                mask &= qi - ki < window
            m = mask[None, None]
            if not sdpa:
                m = torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill(
                    ~m, torch.finfo(q.dtype).min
                )
            sl = slice(first, before + b)
            outs.append(inner(module, q[:, :, a:b], k[:, :, sl], v[:, :, sl], m, **kwargs)[0])
    return torch.cat(outs, dim=1), None


def register_packed_attention() -> str:
    """Make `packed_attention` known to transformers as `PACKED_ATTENTION` (once; later calls
    change nothing); returns the name to set as a model's attention implementation."""
    if ALL_ATTENTION_FUNCTIONS.get(PACKED_ATTENTION) is not packed_attention:
        AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    return PACKED_ATTENTION


def _run_mode(policy_model: Any, device: torch.device) -> tuple[object, ...]:
    """What a prefix's keys and values depend on besides the weights, which a step does not change:
    grad or not, the adapter on or off (the KL reference runs without it), autocast."""
    adapter_off = False
    for m in policy_model.modules():  # the first LoRA layer comes early: layer 0's first projection
        off = getattr(m, "disable_adapters", None)
        if isinstance(off, bool):
            adapter_off = off
            break
    autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    return torch.is_grad_enabled(), adapter_off, autocast


def _run_prefix(
    causal_lm: Any,
    prefix: SharedPrefix,
    mode: tuple[object, ...],
    inner: str,
    device: torch.device,
    kernel: str,
) -> None:
    """One forward of `prefix`'s own tokens after its parent's keys, keeping its keys and values."""
    row = Row(input_ids=[t for node in prefix.chain() for t in node.ids])
    pack = Pack(attention="flex" if kernel == "flex" else "rows")
    pack.add(row, prefix.start, prefix.parent)
    inputs = pack.inputs(device)
    run = _PrefixRun(grad=torch.is_grad_enabled())
    causal_lm.model(
        input_ids=inputs.ids,
        position_ids=inputs.positions,
        use_cache=False,
        pack_call=_PackCall(inputs.layout, inner, [p.runs[mode] for p in inputs.layout.prefixes], run),
    )
    prefix.runs[mode] = run


def packed_logprobs(
    policy_model: Any, inputs: PackedInputs, rows: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """log π(target) at the trained positions of a packed sequence only, as `trained_logprobs` gives
    them for the same rows padded: (rows, pos) index the (B, T-1) target grid of `Pack.rows`.

    The `SharedPrefix`es of the pack's rows are run first where this mode (grad, adapter, autocast)
    has not run them yet this step. The "dense" reference hands transformers a 4-D mask, which it
    uses as given: SDPA takes it as a boolean (True = attend), the other attention implementations
    (eager) add it to the scores, row by row (`row_attention`)."""
    causal_lm: Any = policy_model.get_base_model()
    if inputs.attention == "dense":
        mask = packed_attention_mask(causal_lm.config, inputs, causal_lm.dtype)
        with attention_implementation(causal_lm, register_row_attention()) as inner:
            hidden = causal_lm.model(
                input_ids=inputs.ids,
                position_ids=inputs.positions,
                attention_mask=mask,
                use_cache=False,
                pack_spans=inputs.spans,
                pack_attention=inner,
            ).last_hidden_state  # (1, L, H)
    else:
        layout = inputs.layout
        mode = _run_mode(policy_model, inputs.device)
        with attention_implementation(causal_lm, register_packed_attention()) as inner:
            for prefix in layout.prefixes:  # parents first
                if mode not in prefix.runs:
                    _run_prefix(causal_lm, prefix, mode, inner, inputs.device, layout.kernel)
            hidden = causal_lm.model(
                input_ids=inputs.ids,
                position_ids=inputs.positions,
                use_cache=False,
                pack_call=_PackCall(layout, inner, [p.runs[mode] for p in layout.prefixes], None),
            ).last_hidden_state  # (1, L, H)
    # the hidden state at position p of a row predicts its token p + 1, the target at pos = p
    at, targets = inputs.places[rows, pos], inputs.ids[0, inputs.places[rows, pos + 1]]
    return head_logprobs(hidden[0, at], causal_lm.lm_head, targets)


def pad_rows(batch: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, trained mask, rollout logprobs), each (B, T): rows right-padded to the longest."""
    width = max(len(r.input_ids) for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    trained = torch.zeros((len(batch), width), dtype=torch.bool)
    rollout = torch.full((len(batch), width), math.nan)
    for i, r in enumerate(batch):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        attn[i, :n] = 1
        trained[i, :n] = torch.tensor(r.trained)
        rollout[i, :n] = torch.tensor(r.rollout_logprobs)
    return ids, attn, trained, rollout


def trained_logprobs(
    policy_model: Any,
    ids: torch.Tensor,
    attn: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    targets: torch.Tensor,
    shared: int = 0,
) -> torch.Tensor:
    """log π(target) at the trained positions only: the LM head skips every prompt token.

    `policy_model` is the PEFT model; (rows, pos) index the (B, T-1) target grid, whose position p
    is predicted by the hidden state at p. The first `shared` tokens, the same in every row and
    never trained, run once (see the module docstring); hidden states are then computed for the
    rest only.
    """
    causal_lm: Any = policy_model.get_base_model()
    if not shared:
        hidden = causal_lm.model(input_ids=ids, attention_mask=attn).last_hidden_state  # (B, T, H)
        # the hidden state at position p predicts token p + 1, the target at pos = p
        return head_logprobs(hidden[rows, pos], causal_lm.lm_head, targets)
    b = ids.shape[0]
    prefix = DynamicCache()
    causal_lm.model(input_ids=ids[:1, :shared], past_key_values=prefix, use_cache=True)
    cache = DynamicCache()
    for layer, (k, v) in enumerate(cache_kv(prefix)):
        cache.update(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1), layer)
    positions = torch.arange(shared, ids.shape[1], device=ids.device)[None].expand(b, -1)
    hidden = causal_lm.model(
        input_ids=ids[:, shared:],
        attention_mask=attn,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state  # (B, T - shared, H): position t of the row is hidden[:, t - shared]
    return head_logprobs(hidden[rows, pos - shared], causal_lm.lm_head, targets)
