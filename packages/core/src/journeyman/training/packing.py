"""Rows into micro-batches, and the forward pass that gives their trained tokens' logprobs.

A micro-batch is one packed sequence (`pack_rows`): rows sorted by their token ids and laid end to
end, each after the longest prefix it shares with the row before it, which is already in the
sequence. A 4-D attention mask lets every token see the tokens of its own row up to itself, whether
its row put them there or an earlier row did, so a row's hidden states, logprobs and gradients are
those of the row run alone (test_train.py), with no padding and each shared prompt prefix run once
per micro-batch: the step-wide system prompt and tool definitions of agent rows (~570 of ~700
tokens on an MCP server), and also the prompt the rows of one group share. The padded path
(`pad_rows`, `trained_logprobs`: a prefix common to every row of a batch run once and its keys and
values expanded to the batch) is kept as the reference, and for SFT with packing off.

Packed rather than padded (with the prefix in a KV cache) because it runs about half the token
positions on GRPO steps (docs/); attention runs row by row (`row_attention`), so a longer budget
costs no quadratic term.

`row_attention` reaches transformers through its `AttentionInterface` registry; it is registered
by `register_row_attention`, which `packed_logprobs` calls, never on import.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from journeyman.data.prefix import MIN_SHARED_PREFIX, common_prefix_length
from journeyman.policy.lora import attention_implementation, cache_kv
from journeyman.training.loss import head_logprobs
from journeyman.training.rows import Row

__all__ = [
    "ROW_ATTENTION",
    "Pack",
    "PackedInputs",
    "micro_batches",
    "pack_rows",
    "packed_attention_mask",
    "packed_logprobs",
    "pad_rows",
    "register_row_attention",
    "row_attention",
    "shared_prefix_length",
    "trained_logprobs",
]


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


class PackedInputs(NamedTuple):
    ids: torch.Tensor  # (1, L)
    positions: torch.Tensor  # (1, L) each token's position in its row
    mask: torch.Tensor  # (1, 1, L, L) True where a token may attend
    places: torch.Tensor  # (B, T) where row b's token t sits in the sequence (0 past the row's end)
    # per row, (start, end, places): the span of the sequence it put there, and the places of all
    # its tokens (shared prefix included), the keys its span's queries attend to (`row_attention`)
    spans: list[tuple[int, int, torch.Tensor]]


@dataclass
class Pack:
    """Rows run as one sequence, each after the prefix it shares with the row before it (`pack_rows`)."""

    rows: list[Row] = field(default_factory=list)
    # per row, the place in the sequence of each of its tokens: a shared prefix's places are the
    # places the row before it gave that prefix
    places: list[list[int]] = field(default_factory=list)
    # per row, the span [start, end) of the sequence its own tokens (past the shared prefix) fill
    spans: list[tuple[int, int]] = field(default_factory=list)
    length: int = 0

    def add(self, row: Row, shared: int) -> None:
        """Append `row`, of which the first `shared` tokens are those of the last row added."""
        n = len(row.input_ids)
        prefix = self.places[-1][:shared] if shared else []
        self.places.append(prefix + list(range(self.length, self.length + n - shared)))
        self.spans.append((self.length, self.length + n - shared))
        self.rows.append(row)
        self.length += n - shared

    def inputs(self, device: torch.device) -> PackedInputs:
        """The sequence as model inputs; the mask lets a token see the tokens of its row up to
        itself, no other row's, so a row packed here gives the logprobs it gives alone."""
        ids = torch.zeros(self.length, dtype=torch.long)
        positions = torch.zeros(self.length, dtype=torch.long)
        mask = torch.zeros((self.length, self.length), dtype=torch.bool)
        places = torch.zeros((len(self.rows), max(len(p) for p in self.places)), dtype=torch.long)
        for b, (row, where) in enumerate(zip(self.rows, self.places, strict=True)):
            at = torch.tensor(where)
            ids[at] = torch.tensor(row.input_ids)
            positions[at] = torch.arange(len(where))
            # a shared token gets the same mask row from every row that holds it: the shared prefix
            mask[at[:, None], at] = torch.ones((len(where), len(where)), dtype=torch.bool).tril()
            places[b, : len(where)] = at
        spans = [
            (start, end, torch.tensor(where, device=device))
            for (start, end), where in zip(self.spans, self.places, strict=True)
        ]
        return PackedInputs(
            ids[None].to(device),
            positions[None].to(device),
            mask[None, None].to(device),
            places.to(device),
            spans,
        )


def pack_rows(rows: Sequence[Row], budget: int) -> list[Pack]:
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
            last, shared = Pack(), 0
            packs.append(last)
        last.add(row, shared)
    return packs


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


def packed_logprobs(
    policy_model: Any, inputs: PackedInputs, rows: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """log π(target) at the trained positions of a packed sequence only, as `trained_logprobs` gives
    them for the same rows padded: (rows, pos) index the (B, T-1) target grid of `Pack.rows`.

    transformers uses a 4-D mask as given: SDPA takes it as a boolean (True = attend), the other
    attention implementations (eager) add it to the scores. Attention runs row by row (`row_attention`)."""
    causal_lm: Any = policy_model.get_base_model()
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
