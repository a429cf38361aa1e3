"""Rows into micro-batches, worked out by hand on tiny token ids: no model."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import torch
from journeyman.data.prefix import MIN_SHARED_PREFIX
from journeyman.training.packing import (
    micro_batches,
    pack_rows,
    packed_attention_mask,
    pad_rows,
    row_attention,
    shared_prefix_length,
)
from journeyman.training.rows import Row, truncate_rows


def _row(prompt: list[int], answer: list[int], advantage: float = 1.0) -> Row:
    r = Row(advantage=advantage)
    r.extend(prompt, trained=False)
    r.extend(answer, trained=True, logprobs=[-0.5] * len(answer))
    return r


def test_a_shared_prefix_counts_from_min_shared_prefix_and_stops_before_the_first_trained_token() -> None:
    common = list(range(100, 100 + MIN_SHARED_PREFIX + 8))
    # the prompts differ after `common`; the shortest prompt bounds the prefix: its first trained
    # token (at len(common) + 1) is predicted at len(common), which must run per row
    rows = [_row([*common, 1], [7, 8]), _row([*common, 2, 3], [9])]
    assert shared_prefix_length(rows) == len(common)
    short = [_row([*common, 1], [5]), _row([*common, 1], [6])]  # same prompt: stops one short of it
    assert shared_prefix_length(short) == len(common)

    exactly = [_row([*common[:MIN_SHARED_PREFIX], 1], [7]), _row([*common[:MIN_SHARED_PREFIX], 2], [7])]
    assert shared_prefix_length(exactly) == MIN_SHARED_PREFIX
    below = [
        _row([*common[: MIN_SHARED_PREFIX - 1], 1], [7]),
        _row([*common[: MIN_SHARED_PREFIX - 1], 2], [7]),
    ]
    assert shared_prefix_length(below) == 0  # too short to be worth its own pass
    assert shared_prefix_length([_row([1, 2], [3]), _row([4, 5], [6])]) == 0


def test_micro_batches_keep_the_padded_size_beyond_the_shared_prefix_under_the_budget() -> None:
    rows = [_row(list(range(n - 1)), [1]) for n in (40, 10, 30, 20)]  # lengths 40, 10, 30, 20

    def lengths(shared: int, budget: int) -> list[list[int]]:
        return [[len(r.input_ids) for r in b] for b in micro_batches(rows, budget, shared)]

    # sorted by length; a batch of k rows of width w costs k x w
    assert lengths(0, 70) == [[10, 20], [30], [40]]  # 3 x 30 and 2 x 40 are over 70
    assert lengths(5, 70) == [[10, 20], [30, 40]]  # 2 x (40 - 5) = 70 fits
    assert lengths(0, 10) == [[10], [20], [30], [40]]  # a row over the budget still runs, alone
    assert lengths(0, 1000) == [[10, 20, 30, 40]]


def test_pack_rows_lays_rows_end_to_end_after_the_prefix_each_shares_with_the_row_before() -> None:
    a, b, c = _row([1, 2, 3], [4, 5]), _row([1, 2, 3], [6, 7]), _row([9], [8])
    (pack,) = pack_rows([c, b, a], budget=10)  # sorted by ids: a, b (shares 1 2 3 with a), c
    assert pack.rows == [a, b, c]
    assert pack.places == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 6], [7, 8]]
    assert pack.spans == [(0, 5), (5, 7), (7, 9)]
    assert pack.length == 9  # 12 row tokens, the shared 1 2 3 once

    inputs = pack.inputs(torch.device("cpu"))
    assert inputs.ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 9, 8]]
    assert inputs.positions.tolist() == [[0, 1, 2, 3, 4, 3, 4, 0, 1]]
    assert inputs.places.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 6], [7, 8, 0, 0, 0]]
    assert [(s, e, p.tolist()) for s, e, p in inputs.spans] == [
        (0, 5, [0, 1, 2, 3, 4]),
        (5, 7, [0, 1, 2, 5, 6]),
        (7, 9, [7, 8]),
    ]
    assert inputs.mask.shape == (1, 1, 9, 9)
    mask = inputs.mask[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0],  # a's 4
        [1, 1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 0],  # b's 6: the shared prefix and itself, not a's 4 5
        [1, 1, 1, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 1, 0],  # c sees nothing of a or b
        [0, 0, 0, 0, 0, 0, 0, 1, 1],
    ]


def test_pack_rows_starts_a_new_sequence_at_the_budget() -> None:
    a, b, c = _row([1, 2, 3], [4, 5]), _row([1, 2, 3], [6, 7]), _row([9], [8])
    assert [p.length for p in pack_rows([a, b, c], budget=8)] == [7, 2]  # c would make 9
    packs = pack_rows([a, b, c], budget=6)  # b's own 2 tokens would make 7: b starts over, in full
    assert [p.rows for p in packs] == [[a], [b], [c]]
    assert [p.places for p in packs] == [[[0, 1, 2, 3, 4]], [[0, 1, 2, 3, 4]], [[0, 1]]]
    long = _row(list(range(10, 20)), [1])
    assert [(p.rows, p.length) for p in pack_rows([long], budget=4)] == [([long], 11)]  # alone, whole


def test_a_row_the_row_before_holds_whole_adds_no_token() -> None:
    a, twin = _row([1, 2], [3]), _row([1, 2], [3], advantage=-1.0)
    (pack,) = pack_rows([a, twin], budget=3)
    assert pack.length == 3 and pack.places == [[0, 1, 2], [0, 1, 2]] and pack.spans == [(0, 3), (3, 3)]


def test_packed_attention_mask_adds_the_sliding_window_per_layer_type() -> None:
    (pack,) = pack_rows([_row([1, 2, 3], [4, 5]), _row([1, 2, 3], [6, 7])], budget=10)
    inputs = pack.inputs(torch.device("cpu"))
    full = SimpleNamespace(_attn_implementation="sdpa")
    assert packed_attention_mask(full, inputs, torch.float32) is inputs.mask

    mixed = SimpleNamespace(
        _attn_implementation="sdpa", sliding_window=2, layer_types=["full_attention", "sliding_attention"]
    )
    masks = packed_attention_mask(mixed, inputs, torch.float32)
    assert isinstance(masks, dict) and masks["full_attention"] is inputs.mask
    # the second row's last token (place 6, position 4) sees positions 3 and 4 of its row: places 5, 6
    assert masks["sliding_attention"][0, 0, 6].int().tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert masks["sliding_attention"][0, 0, 4].int().tolist() == [0, 0, 0, 1, 1, 0, 0]

    eager = SimpleNamespace(_attn_implementation="eager", sliding_window=2)  # every layer slides
    additive = packed_attention_mask(eager, inputs, torch.float32)
    assert isinstance(additive, torch.Tensor) and additive.dtype == torch.float32
    low = torch.finfo(torch.float32).min
    assert additive[0, 0, 6].tolist() == [low, low, low, low, low, 0.0, 0.0]


def test_row_attention_gives_the_whole_masked_product() -> None:
    """Row by row over each row's own keys gives what SDPA over the whole (L, L) mask gives."""
    rows = [_row([1, 2, 3], [4, 5]), _row([1, 2, 3], [6, 7, 8]), _row([1, 2, 3], [4, 5]), _row([9], [8])]
    (pack,) = pack_rows(rows, budget=100)
    inputs = pack.inputs(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, pack.length, 8, generator=g) for _ in range(3))  # (1, heads, L, d)
    module = torch.nn.Module()
    got, _ = row_attention(module, q, k, v, inputs.mask, pack_spans=inputs.spans, pack_attention="sdpa")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=inputs.mask[0, 0])
    assert got.shape == (1, pack.length, 2, 8)
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-6, rtol=1e-5)


def test_pad_rows_and_truncate_rows() -> None:
    a, b = _row([1, 2], [3]), _row([4], [5, 6, 7])
    ids, attn, trained, rollout = pad_rows([a, b])
    assert ids.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert attn.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert trained.tolist() == [[False, False, True, False], [False, True, True, True]]
    assert rollout[0, 2] == -0.5 and rollout[1, 1:].tolist() == [-0.5] * 3
    assert rollout[0, :2].isnan().all() and rollout[0, 3].isnan() and rollout[1, 0].isnan()

    assert truncate_rows([a, b], 3) == 1
    assert b.input_ids == [4, 5, 6] and b.trained == [False, True, True] and len(b.rollout_logprobs) == 3
    assert a.input_ids == [1, 2, 3]


_REGISTRATION = """
import json
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import journeyman.engine.torch_engine, journeyman.training.distributed, journeyman.training.sft
from journeyman.engine import slot_attention as sa
from journeyman.training import packing

names = [packing.ROW_ATTENTION, sa.SLOT_ATTENTION]
seen = {"imported": [n for n in names if n in ALL_ATTENTION_FUNCTIONS or n in ALL_MASK_ATTENTION_FUNCTIONS]}
sizes = [[len(ALL_ATTENTION_FUNCTIONS), len(ALL_MASK_ATTENTION_FUNCTIONS)]]
for _ in range(2):
    seen["returned"] = [packing.register_row_attention(), sa.register_slot_attention()]
    sizes.append([len(ALL_ATTENTION_FUNCTIONS), len(ALL_MASK_ATTENTION_FUNCTIONS)])
seen["sizes"] = sizes
seen["functions"] = [
    ALL_ATTENTION_FUNCTIONS[packing.ROW_ATTENTION] is packing.row_attention,
    ALL_ATTENTION_FUNCTIONS[sa.SLOT_ATTENTION] is sa.slot_attention,
    packing.ROW_ATTENTION in ALL_MASK_ATTENTION_FUNCTIONS,
    sa.SLOT_ATTENTION in ALL_MASK_ATTENTION_FUNCTIONS,
]
print(json.dumps(seen))
"""


def test_importing_registers_nothing_with_transformers_and_registering_is_idempotent() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _REGISTRATION], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["imported"] == []
    assert seen["returned"] == ["journeyman_rows", "journeyman_slots"]
    before, first, second = seen["sizes"]
    assert first == [
        before[0] + 2,
        before[1],
    ]  # two attention functions; no mask function (theirs are their own)
    assert second == first  # a second call adds nothing
    assert seen["functions"] == [True, True, False, False]
