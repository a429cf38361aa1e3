"""Attention over packed rows without an (L, L) mask, and prompt prefixes run once per step, on a tiny
random-weight Llama (and a Qwen2 with a sliding-window layer) with a LoRA adapter, in fp32: every
row's logprobs and the LoRA gradients equal those of each row run alone."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from _support import TINY_SHAPE, tiny_llama_config
from journeyman.training import packing
from journeyman.training.packing import (
    Pack,
    PackAttention,
    PrefixTree,
    pack_rows,
    pack_tree,
    packed_logprobs,
    pad_rows,
)
from journeyman.training.rows import Row
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen2Config

CPU = torch.device("cpu")
VOCAB = 96


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """A 64-wide model gains nothing from a second thread, and beside another test process on two
    cores the threads' waits for each other cost several times the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(config: PretrainedConfig | None = None) -> Any:
    """A 2-layer model with random weights and a LoRA adapter whose matrices are all nonzero."""
    torch.manual_seed(0)
    config = config or tiny_llama_config(VOCAB, 8192)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.05)
    return model.train()


def _params(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _row(*parts: tuple[list[int], bool], advantage: float = 1.0) -> Row:
    r = Row(advantage=advantage)
    for ids, trained in parts:
        r.extend(ids, trained=trained, logprobs=[-1.0] * len(ids) if trained else None)
    return r


def _agent_rows() -> list[Row]:
    """Two groups under one system prompt (each group's prompt long enough to be run on its own),
    a twin, two rows that share a trained turn, a row with nothing in common with the others."""
    system = _tokens(1, 48)
    task_a, task_b = _tokens(2, 40), _tokens(3, 36)
    rows = [
        _row((system + task_a, False), (_tokens(10 + i, 6 + 3 * i), True), advantage=1.0 - i / 2)
        for i in range(4)
    ]
    rows.append(_row((system + task_a, False), (_tokens(10, 6), True), advantage=-0.5))  # rows[0]'s twin
    turn, tool = _tokens(20, 7), _tokens(21, 5)
    rows += [
        _row(
            (system + task_b, False), (turn, True), (tool, False), (_tokens(22 + i, 4 + i), True), advantage=a
        )
        for i, a in enumerate((1.0, -1.0))
    ]
    rows.append(_row((system + task_b, False), (_tokens(30, 9), True), advantage=0.5))
    rows.append(_row((_tokens(40, 12), False), (_tokens(41, 5), True), advantage=-1.0))
    return rows


def _weights(rows: Sequence[Row]) -> dict[int, torch.Tensor]:
    """Per-token weights fixed per row, so a logprob landing on another row or token changes the sum."""
    return {id(r): torch.linspace(-1, 1, sum(r.trained[1:])) * (i + 1) for i, r in enumerate(rows)}


def _trained_counts(rows: Sequence[Row]) -> list[int]:
    return [sum(r.trained[1:]) for r in rows]


def _alone(model: Any, rows: Sequence[Row]) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """Each row run by itself through the model's own (SDPA) attention: logprobs of its trained
    tokens, and the gradient of the weighted sum."""
    weights, logps = _weights(rows), {}
    total = torch.zeros(())
    for r in rows:
        lp = _row_logprobs(model, r)
        logps[id(r)] = lp.detach()
        total = total + (weights[id(r)] * lp).sum()
    return logps, list(torch.autograd.grad(total, _params(model)))


def _row_logprobs(model: Any, row: Row) -> torch.Tensor:
    ids = torch.tensor([row.input_ids])
    logits = model(input_ids=ids).logits[0, :-1]
    at = torch.tensor(row.trained[1:]).nonzero()[:, 0]
    return torch.log_softmax(logits[at], -1).gather(-1, ids[0, at + 1, None])[:, 0]


def _packed(
    model: Any, packs: Sequence[Pack], weights: dict[int, torch.Tensor], tree: PrefixTree | None = None
) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """As the trainer runs a step: one forward and backward per pack, gradients accumulated, then
    the shared prefixes' backward."""
    model.zero_grad(set_to_none=True)
    logps: dict[int, torch.Tensor] = {}
    for p in packs:
        rows_idx, pos_idx = pad_rows(p.rows)[2][:, 1:].nonzero(as_tuple=True)
        logp = packed_logprobs(model, p.inputs(CPU), rows_idx, pos_idx)
        parts = logp.split(_trained_counts(p.rows))
        torch.stack(
            [(weights[id(r)] * lp).sum() for r, lp in zip(p.rows, parts, strict=True)]
        ).sum().backward()
        logps |= {id(r): lp.detach() for r, lp in zip(p.rows, parts, strict=True)}
    if tree is not None:
        tree.backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in _params(model)]
    model.zero_grad(set_to_none=True)
    return logps, grads


def _assert_same(
    want: tuple[dict[int, torch.Tensor], list[torch.Tensor]],
    got: tuple[dict[int, torch.Tensor], list[torch.Tensor]],
) -> None:
    (lp_want, g_want), (lp_got, g_got) = want, got
    assert lp_want.keys() == lp_got.keys()
    for k in lp_want:
        torch.testing.assert_close(lp_got[k], lp_want[k], rtol=1e-5, atol=1e-5)
    num = sum(float((a - b).norm() ** 2) for a, b in zip(g_want, g_got, strict=True)) ** 0.5
    den = sum(float(a.norm() ** 2) for a in g_want) ** 0.5
    assert all(float(g.norm()) > 0 for g in g_want)  # lora_A and lora_B of every adapted layer
    assert num / den < 1e-5, num / den


def test_pack_tree_runs_each_shared_prompt_prefix_once_and_packs_what_follows() -> None:
    system, a, b = list(range(100, 140)), list(range(200, 240)), list(range(300, 310))
    rows = [
        _row((system + a, False), ([1, 2], True)),
        _row((system + a, False), ([3], True)),
        _row((system + b, False), ([4, 5, 6], True)),  # b is 10 tokens: too short to run on its own
        _row((system + b, False), ([7], True)),
        _row(([500] * 40, False), ([8], True)),  # shares nothing
    ]
    tree = pack_tree(rows, budget=10, attention="rows")
    sys_prefix, a_prefix = tree.prefixes
    assert (sys_prefix.ids, sys_prefix.start, sys_prefix.parent) == (system, 0, None)
    # a's last token predicts the first trained one: it runs with the rows
    assert (a_prefix.ids, a_prefix.start, a_prefix.parent) == (a[:-1], 40, sys_prefix)
    assert a_prefix.chain() == [sys_prefix, a_prefix]
    assert [p.rows for p in tree.packs] == [rows[:2], [rows[2]], [rows[3]], [rows[4]]]
    assert [p.prefixes for p in tree.packs] == [[a_prefix, a_prefix], [sys_prefix], [sys_prefix], [None]]
    # a row starts at its prefix's end (-1: in the prefix), after what it shares with the row before
    assert tree.packs[0].places == [[-1] * 79 + [0, 1, 2], [-1] * 79 + [0, 3]]
    assert tree.packs[1].places == [[-1] * 40 + list(range(13))]
    assert tree.packs[2].places == [[-1] * 40 + list(range(11))]  # b again: a new pack, b too short to share
    assert [p.length for p in tree.packs] == [4, 13, 11, 41]
    assert tree.forward_tokens == 4 + 13 + 11 + 41 + 40 + 39  # the system prompt once for three packs
    assert sum(p.length for p in pack_rows(rows, budget=10)) == 82 + 81 + 53 + 51 + 41

    # the layout: the queries at places [lo, hi) see each key; the prefixes' keys come first
    layout = tree.packs[0].inputs(CPU).layout
    assert layout.prefixes == [sys_prefix, a_prefix]
    assert layout.lo.tolist() == [0] * 79 + [0, 1, 2, 3]
    assert layout.hi.tolist() == [4] * 79 + [4, 3, 3, 4]  # place 0 is both rows', 1 and 2 the first's
    assert layout.span_lengths == [3, 1] and layout.row_lengths == [82, 81]
    assert layout.row_keys.tolist() == [*range(82), *range(79), 79, 82]


def _blocks(dense: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) of each size x size block of a (q, k) mask, padded with False."""
    q, k = dense.shape
    nq, nk = -(-q // size), -(-k // size)
    padded = torch.zeros(nq * size, nk * size, dtype=torch.bool)
    padded[:q, :k] = dense
    tiles = padded.view(nq, size, nk, size).transpose(1, 2).flatten(2)
    return tiles.any(-1), tiles.all(-1)


def _listed(num: torch.Tensor, idx: torch.Tensor, nk: int) -> torch.Tensor:
    out = torch.zeros(num.shape[-1], nk, dtype=torch.bool)
    for i, (n, row) in enumerate(zip(num[0, 0].tolist(), idx[0, 0], strict=True)):
        out[i, row[:n].long()] = True
    return out


def test_the_key_intervals_and_the_block_mask_give_the_dense_mask() -> None:
    """On packs without prefixes, key k seen by queries [lo[k], hi[k]) is the dense reference mask
    exactly, and so is the FlexAttention mask function at every (query, key); the block mask lists
    every 128 x 128 block with a key seen, as full the blocks whose every key is seen by every query."""
    long = [
        _row((_tokens(1, 48) + _tokens(50 + g, 40), False), (_tokens(60 + 4 * g + i, 100 + 90 * i), True))
        for g in range(2)
        for i in range(3)
    ]
    checked_full = False
    for rows, budget in [(_agent_rows(), 40), (_agent_rows(), 90), (_agent_rows(), 1000), (long, 900)]:
        for p in pack_rows(rows, budget):
            inputs = p.inputs(CPU)
            layout = packing.PackLayout.of(p, inputs.positions[0], "flex")
            q = torch.arange(p.length)[:, None]
            intervals = (layout.lo[None] <= q) & (q < layout.hi[None])
            assert torch.equal(intervals, inputs.mask[0, 0])
            block = layout.block_mask(None)
            k = torch.arange(p.length)[None]
            assert torch.equal(block.mask_mod(0, 0, q, k), inputs.mask[0, 0])
            window = 5
            pos = inputs.positions[0]
            slid = inputs.mask[0, 0] & (pos[:, None] - pos[None] < window)
            assert torch.equal(layout.block_mask(window).mask_mod(0, 0, q, k), slid)
            seen, full = _blocks(inputs.mask[0, 0], 128)
            if p.length % 128:  # a last block short of 128 queries is never called full
                full[-1] = False
            nk = seen.shape[1]
            assert torch.equal(_listed(block.full_kv_num_blocks, block.full_kv_indices, nk), full)
            assert torch.equal(_listed(block.kv_num_blocks, block.kv_indices, nk), seen & ~full)
            checked_full = checked_full or bool(full.any())
    assert checked_full


@pytest.mark.parametrize("attention", ["rows", "dense"])
def test_packed_rows_give_each_row_alone(attention: PackAttention, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows packed several to a sequence (shared prompt prefixes once per sequence, a twin, a shared
    trained turn): logprobs and LoRA gradients of each row run alone, with no (L, L) mask for "rows";
    its long-row chunking is forced on with a tiny mask budget."""
    monkeypatch.setattr(packing, "_ROW_MASK_ELEMENTS", 512)
    model, rows = _model(), _agent_rows()
    want = _alone(model, rows)
    packs = pack_rows(rows, budget=150, attention=attention)
    assert len(packs) >= 2 and any(len(p.rows) > 2 for p in packs)
    _assert_same(want, _packed(model, packs, _weights(rows)))


def test_prefixes_run_once_per_step_give_each_row_alone() -> None:
    """The system prompt and each group's prompt run once for the step, their rows spread over
    several micro-batches: logprobs and LoRA gradients of each row run alone."""
    model, rows = _model(), _agent_rows()
    want = _alone(model, rows)
    tree = pack_tree(rows, budget=24, attention="rows")
    assert len(tree.prefixes) == 3 and len(tree.packs) >= 3  # system, then group a's and group b's prompts
    embedded: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: embedded.append(o.shape[1]))
    try:
        got = _packed(model, tree.packs, _weights(rows), tree)
    finally:
        hook.remove()
    assert sum(embedded) == tree.forward_tokens  # each prefix ran once, not once per micro-batch
    assert all(not p.runs for p in tree.prefixes)  # dropped after the backward
    _assert_same(want, got)


def test_a_sliding_window_layer_sees_its_window_only() -> None:
    """Qwen2 with one full and one sliding layer (window 6): the per-layer window reaches the packed
    attention (no mask of the model's own is built), prefixes run once included."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        **TINY_SHAPE,
        use_sliding_window=True,
        sliding_window=6,
        layer_types=["full_attention", "sliding_attention"],
    )
    model, rows = _model(config), _agent_rows()
    want = _alone(model, rows)
    tree = pack_tree(rows, budget=24, attention="rows")
    _assert_same(want, _packed(model, tree.packs, _weights(rows), tree))
    _assert_same(want, _packed(model, pack_rows(rows, budget=150, attention="rows"), _weights(rows)))


def test_the_reference_pass_runs_its_own_prefixes_without_grad_or_adapter() -> None:
    """The KL reference (no grad, adapter off) between a micro-batch's forward and its backward gets
    prefixes run in its own mode, and leaves the policy's gradient as it was."""
    model, rows = _model(), _agent_rows()
    with torch.no_grad(), model.disable_adapter():
        ref_want = {id(r): _row_logprobs(model, r) for r in rows}
    want = _alone(model, rows)
    tree = pack_tree(rows, budget=24, attention="rows")
    weights = _weights(rows)
    ref_got: dict[int, torch.Tensor] = {}
    model.zero_grad(set_to_none=True)
    for p in tree.packs:
        rows_idx, pos_idx = pad_rows(p.rows)[2][:, 1:].nonzero(as_tuple=True)
        inputs = p.inputs(CPU)
        logp = packed_logprobs(model, inputs, rows_idx, pos_idx)
        with torch.no_grad(), model.disable_adapter():
            ref = packed_logprobs(model, inputs, rows_idx, pos_idx)
        ref_got |= zip(map(id, p.rows), ref.split(_trained_counts(p.rows)), strict=True)
        parts = logp.split(_trained_counts(p.rows))
        torch.stack(
            [(weights[id(r)] * lp).sum() for r, lp in zip(p.rows, parts, strict=True)]
        ).sum().backward()
    assert all(len(p.runs) == 2 for p in tree.prefixes)  # the policy's run and the reference's
    tree.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in _params(model)]
    for k, lp in ref_want.items():
        torch.testing.assert_close(ref_got[k], lp, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(lp, want[0][k], atol=1e-3)  # the adapter changes them
    num = sum(float((a - b).norm() ** 2) for a, b in zip(want[1], grads, strict=True)) ** 0.5
    assert num / sum(float(a.norm() ** 2) for a in want[1]) ** 0.5 < 1e-5


def test_prefixes_run_once_under_gradient_checkpointing() -> None:
    """With the decoder layers checkpointed (the trainer's switch), a layer's recompute in the
    backward calls the attention again: a prefix keeps the keys of its first forward, and the
    gradients stay those of each row alone."""
    from journeyman.training.trainer import gradient_checkpointing

    model, rows = _model(), _agent_rows()
    want = _alone(model, rows)

    class _Holder:  # what the trainer's switch reads from a LoraPolicy
        def __init__(self, model: Any) -> None:
            self.model = model

    tree = pack_tree(rows, budget=24, attention="rows")
    with gradient_checkpointing(_Holder(model)):  # pyright: ignore[reportArgumentType]
        got = _packed(model, tree.packs, _weights(rows), tree)
    _assert_same(want, got)


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator returns while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@contextlib.contextmanager
def _largest() -> Iterator[_LargestTensor]:
    with _LargestTensor() as mode:
        yield mode


def test_a_4k_token_pack_makes_no_tensor_of_its_length_squared() -> None:
    """A 4096-token step (groups of rows under one system prompt, and a 3000-token row): forward and
    backward with the packed attention create no tensor of L x L / 2 elements; the dense reference
    creates its L x L mask."""
    system = _tokens(1, 64)
    rows = [
        _row((system + _tokens(100 + g, 40), False), (_tokens(200 + 8 * g + i, 50 + 10 * i), True))
        for g in range(3)
        for i in range(4)
    ]
    rows.append(_row((system + _tokens(7, 100), False), (_tokens(8, 2900), True)))
    model = _model()
    weights = _weights(rows)
    tree = pack_tree(rows, budget=4096, attention="rows")
    (pack,) = pack_rows(rows, budget=4096, attention="dense")
    length = pack.length
    assert length > 3900
    with _largest() as seen:
        _packed(model, tree.packs, weights, tree)
    assert seen.largest < length * length // 2, (seen.largest, length)
    with _largest() as dense:
        _packed(model, [pack], weights)
    assert dense.largest >= length * length


@pytest.mark.slow  # torch traces its unfused FlexAttention anew at each call: ~30 s here
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_gives_each_row_alone_without_grad() -> None:
    """FlexAttention with the layout's block mask (what CUDA runs; on the CPU torch's unfused
    reference, without grad) gives the rows' logprobs, prefixes run once included. The block mask
    itself is checked against the dense mask above, fast."""
    model, rows = _model(), _agent_rows()
    with torch.no_grad():
        want = {id(r): _row_logprobs(model, r) for r in rows}
        tree = pack_tree(rows, budget=60, attention="flex")
        for p in tree.packs:
            rows_idx, pos_idx = pad_rows(p.rows)[2][:, 1:].nonzero(as_tuple=True)
            logp = packed_logprobs(model, p.inputs(CPU), rows_idx, pos_idx)
            for r, lp in zip(p.rows, logp.split(_trained_counts(p.rows)), strict=True):
                torch.testing.assert_close(lp, want[id(r)], rtol=1e-5, atol=1e-5)
