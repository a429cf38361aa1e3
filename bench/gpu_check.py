"""One command for any GPU machine: every CUDA path of the trainer and engine that runs without vLLM,
timed and checked, as one table and a JSON file.

Sections (torch, transformers and peft; no hub download, no vLLM):

1. a GRPO train step (`GRPOTrainer.step`) in fp32, TF32 and bf16 on the base model: s/step, peak
   memory, loss (the mean NLL of the trained tokens on the first step, from the same adapter);
2. the same on a random-weight config as wide as Qwen2.5-7B (hidden 3584, intermediate 18944, 28
   heads, 4 KV heads) cut to `--wide-layers` decoder layers;
3. gradient checkpointing: peak memory and time of one micro-step on one 4k / 16k / 32k-token row
   of that model, off and on (`bench/long_rows.py`), beside the memory plan's estimate;
4. the packed attention (no (L, L) mask) against the per-row and dense references: max |diff| of
   logprobs, relative diff of LoRA gradients (`bench/packed_attention_check.py`);
5. the memory handoff: a real train step, `handoff.return_cached_memory`, then an allocation of what
   a woken engine could claim in a second process, which must succeed;
6. decode tokens/s of the in-process torch engine at 8, 32 and 128 rows, eager and replayed (CUDA
   graphs), and the two modes' greedy logprobs against each other;
7. `bench/grpo_step.py`: Journeyman's GRPO step against TRL's (skipped without TRL);
8. `bench/vllm_wake_check.py` (skipped, with its reason, without vLLM or CUDA).

The base model: `--base-model DIR` (a local HF model directory), else the embedded SmolLM2-135M when
its package is installed, else a random-weight model of SmolLM2-135M's shape built from its config
(below) with a stand-in tokenizer; the table's first rows say which. Section 7 needs real weights
(the task's reward reads the sampled text) and is skipped on the random-weight stand-in.

Each section has a time budget; the whole run stays inside `--budget-s` (570 s: 10 minutes on an
H100 with the start-up). A failed section prints its error in its row and the others still run.
`--dry-run` runs every section at toy size on whatever device there is (the CPU test runs it).

    uv run python bench/gpu_check.py --dry-run                 # toy sizes, any machine
    python bench/gpu_check.py --json gpu_check.json            # a GPU machine (docs/scale.md)
    python bench/gpu_check.py --base-model /models/SmolLM2-135M-Instruct --sections 1,6
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("journeyman") is None:  # a bare checkout on a GPU machine: the source tree
    sys.path.insert(1, str(ROOT / "packages" / "core" / "src"))

import torch  # noqa: E402

if TYPE_CHECKING:
    from journeyman.data.types import TrajectoryGroup
    from journeyman.policy.lora import LoraPolicy

GiB = 1 << 30

# SmolLM2-135M(-Instruct)'s config.json: the fields that shape the model. Token ids are the stand-in
# tokenizer's (`write_tokenizer`), which puts <|endoftext|>, <|im_start|>, <|im_end|> at 0, 1, 2 as
# SmolLM2's does.
SMOLLM2_135M: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
# Qwen2.5-7B's widths and vocabulary; its layers are cut to `--wide-layers`, its context raised so a
# 32k-token row has positions.
QWEN25_7B_WIDTH: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 4,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
# --dry-run: the same architectures, small (the wide one's vocabulary stays above the ids up to 40000
# that bench/long_rows.py draws)
TOY_SMALL = SMOLLM2_135M | {
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
TOY_WIDE = QWEN25_7B_WIDTH | {
    "vocab_size": 40960,
    "hidden_size": 112,  # 28 heads of 4
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "max_position_embeddings": 4096,
}
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# equality of the packed attention with the references, fp32 with TF32 off
LOGPROB_TOLERANCE = 2e-3
GRAD_TOLERANCE = 1e-2
# what a second process's CUDA context and the driver's granules take beside its allocation
CHILD_CONTEXT_BYTES = 3 * GiB // 2


@dataclass(frozen=True)
class Sizes:
    """How big each section runs: `REAL` on a GPU, `DRY` for --dry-run."""

    groups: int  # section 1: groups x rollouts rows, a shared prompt, completions of lo..hi tokens
    wide_groups: int  # section 2
    rollouts: int
    prompt: int
    completion: tuple[int, int]
    warmup: int
    steps: int
    ckpt_tokens: tuple[int, ...]
    packed_tokens: tuple[int, ...]
    packed_width: str
    handoff_tokens: int
    decode_rows: tuple[int, ...]
    decode_prompt: int
    decode_tokens: int
    grpo_steps: int
    grpo_task: tuple[int, int, int] | None  # (prompts, group, max tokens) over grpo_step's own
    budgets: dict[int, float]  # seconds per section


REAL = Sizes(
    groups=4,
    wide_groups=2,
    rollouts=8,
    prompt=600,
    completion=(100, 200),
    warmup=1,
    steps=2,
    ckpt_tokens=(4096, 16384, 32768),
    packed_tokens=(4096,),
    packed_width="135m",
    handoff_tokens=8192,
    decode_rows=(8, 32, 128),
    decode_prompt=128,
    decode_tokens=128,
    grpo_steps=3,
    grpo_task=None,
    budgets={1: 75, 2: 75, 3: 130, 4: 60, 5: 45, 6: 100, 7: 150, 8: 120},
)
DRY = Sizes(
    groups=1,
    wide_groups=1,
    rollouts=4,
    prompt=24,
    completion=(8, 16),
    warmup=0,
    steps=1,
    ckpt_tokens=(64, 256),
    packed_tokens=(64,),
    packed_width="toy",
    handoff_tokens=256,
    decode_rows=(8, 32, 128),
    decode_prompt=8,
    decode_tokens=4,
    grpo_steps=1,
    grpo_task=(2, 2, 4),
    budgets={1: 60, 2: 60, 3: 60, 4: 60, 5: 60, 6: 60, 7: 60, 8: 60},
)


@dataclass
class Result:
    """One line of the table: `figure` a number (in `unit`) or a word; ok None where nothing is judged."""

    section: str
    setting: str
    figure: float | str | None
    unit: str = ""
    ok: bool | None = None
    note: str = ""


@dataclass
class Check:
    """The run's state: where it runs, the models it built, the rows so far, the clock."""

    device: torch.device
    dry: bool
    sizes: Sizes
    work: Path
    deadline: float
    vllm_python: str | None = None
    base_dir: Path | None = None
    base_label: str = ""
    base_is_random: bool = False
    unavailable: str | None = None  # why journeyman does not import here
    rows: list[Result] = field(default_factory=list)
    section: str = ""
    section_deadline: float = 0.0
    start: float = field(default_factory=time.monotonic)
    _wide_dir: Path | None = None

    def add(
        self, setting: str, figure: float | str | None, unit: str = "", ok: bool | None = None, note: str = ""
    ) -> None:
        self.rows.append(Result(self.section, setting, figure, unit, ok, note))

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f} s] {message}", flush=True)

    def time_left(self) -> float:
        """Seconds left to this section: its own budget, within the whole run's."""
        return min(self.deadline, self.section_deadline) - time.monotonic()

    def out_of_time(self, what: str) -> bool:
        """True (and a skipped row for `what`) when this section's budget is spent."""
        if self.time_left() > 0:
            return False
        self.add(what, "skipped", ok=None, note="this section's time budget is spent")
        return True

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def wide_dir(self, layers: int) -> Path:
        """The random-weight 7B-width model, written once (bf16 on CUDA: 4 GB at 4 layers)."""
        if self._wide_dir is None:
            config = (TOY_WIDE if self.dry else QWEN25_7B_WIDTH) | (
                {} if self.dry else {"num_hidden_layers": layers}
            )
            dtype = torch.bfloat16 if self.cuda else torch.float32
            self.say(f"writing a random-weight 7B-width model ({config['num_hidden_layers']} layers)")
            self._wide_dir = write_model(self.work / "wide", config, dtype, self.device)
        return self._wide_dir


# -- models -----------------------------------------------------------------------------------------


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A stand-in tokenizer for a random-weight model: one word per id ("t123"), ChatML's special
    tokens at 0-2 and SmolLM2's chat template, so the policy, the chat format and the engine load
    it as they load a real one (text encodes to the unknown id; ids decode to words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2} | {
        f"t{i}": i for i in range(3, vocab_size)
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # pyright: ignore[reportAttributeAccessIssue]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML
    fast.save_pretrained(out)


def write_model(out: Path, config: dict[str, Any], dtype: torch.dtype, device: torch.device) -> Path:
    """A random-weight model of `config` (initialised on `device`, fast for billions of weights) and a
    stand-in tokenizer, saved as a model directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(config)
    cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(out)
    del model
    write_tokenizer(out, int(config["vocab_size"]))
    free_memory()
    return out


def choose_base(ck: Check, base_model: str | None) -> None:
    """`--base-model`, else the embedded model, else a random-weight SmolLM2-135M (see the docstring)."""
    if ck.dry:
        ck.base_dir = write_model(ck.work / "small", TOY_SMALL, torch.float32, ck.device)
        ck.base_label, ck.base_is_random = "toy SmolLM2 shape, random weights (dry run)", True
        return
    from journeyman.data.config import DEFAULT_BASE_MODEL
    from journeyman.errors import BaseModelNotFoundError
    from journeyman.policy.weights import resolve_base_model

    if base_model is not None:
        ck.base_dir, ck.base_label = resolve_base_model(base_model), f"--base-model {base_model}"
        return
    try:
        ck.base_dir, ck.base_label = resolve_base_model(DEFAULT_BASE_MODEL), "embedded SmolLM2-135M-Instruct"
    except (BaseModelNotFoundError, ImportError) as e:  # not installed, or its converter missing
        ck.say(f"no embedded model ({e}); building SmolLM2-135M's shape with random weights")
        ck.base_dir = write_model(ck.work / "small", SMOLLM2_135M, torch.float32, ck.device)
        ck.base_label = "random-weight SmolLM2-135M shape (embedded model not installed)"
        ck.base_is_random = True


@contextlib.contextmanager
def embedded_as(ck: Check) -> Iterator[None]:
    """Inside the block, `resolve_base_model(DEFAULT_BASE_MODEL)` answers the base model chosen here
    (a cache of links under `$JOURNEYMAN_CACHE`), for benches that load the embedded model by name."""
    from journeyman.data.config import DEFAULT_BASE_MODEL

    if ck.base_label.startswith("embedded") or ck.base_dir is None:
        yield
        return
    cache = ck.work / "cache"
    entry = cache / "models" / DEFAULT_BASE_MODEL
    if not entry.exists():
        entry.mkdir(parents=True)
        for f in ck.base_dir.iterdir():
            if not f.name.startswith("."):
                (entry / f.name).symlink_to(f.resolve())
        (entry / ".complete").write_text("ok\n")
    before = os.environ.get("JOURNEYMAN_CACHE")
    os.environ["JOURNEYMAN_CACHE"] = str(cache)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("JOURNEYMAN_CACHE", None)
        else:
            os.environ["JOURNEYMAN_CACHE"] = before


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else None


# -- rows -------------------------------------------------------------------------------------------


def agent_groups(
    vocab: int, groups: int, rollouts: int, prompt: int, completion: tuple[int, int], seed: int = 0
) -> list[TrajectoryGroup]:
    """`groups` x `rollouts` trajectories as the endpoint records them: a `prompt`-token system
    prompt every group shares, a 16-token task per group, a completion of random ids per rollout.
    The recorded logprobs are 0, so the trainer's `engine_trainer_logprob_gap` is the mean NLL of
    the trained tokens; rewards alternate 0, 1 so every group has signal."""
    from journeyman.data.types import TokenRecord, Trajectory, TrajectoryGroup
    from openai.types.chat.chat_completion import Choice

    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    system = ids(prompt)
    out: list[TrajectoryGroup] = []
    for _ in range(groups):
        task = system + ids(16)
        trajectories = []
        for i in range(rollouts):
            n = int(torch.randint(completion[0], completion[1] + 1, (1,), generator=gen))
            record = TokenRecord(
                prompt_token_ids=task,
                token_ids=ids(n),
                logprobs=[0.0] * n,
                model="gpu-check@0",
                step=0,
                finish_reason="length",
            )
            choice = Choice.model_validate(
                {
                    "index": 0,
                    "finish_reason": "length",
                    "message": {"role": "assistant", "content": ""},
                    "journeyman": record.model_dump(),
                }
            )
            trajectories.append(
                Trajectory(messages_and_choices=[{"role": "user", "content": "task"}, choice], reward=i % 2)
            )
        out.append(TrajectoryGroup(trajectories))
    return out


def lora_state(policy: LoraPolicy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def restore_lora(policy: LoraPolicy, state: dict[str, torch.Tensor]) -> None:
    with policy.editing(), torch.no_grad():
        for n, p in policy.model.named_parameters():
            if n in state:
                p.copy_(state[n])
        policy.version += 1


# -- sections ---------------------------------------------------------------------------------------


def precision_steps(ck: Check, name: str, model_dir: Path, groups: int) -> None:
    """fp32, TF32, bf16 train steps of the model in `model_dir` (sections 1 and 2)."""
    from journeyman.chat.formats import ChatFormat
    from journeyman.data.config import TrainConfig
    from journeyman.policy.lora import LoraPolicy
    from journeyman.training.trainer import GRPOTrainer, uses_checkpointing

    s = ck.sizes
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    data = agent_groups(vocab, groups, s.rollouts, s.prompt, s.completion)
    config = TrainConfig(learning_rate=1e-5)
    ckpt = uses_checkpointing(config.gradient_checkpointing, ck.device)
    shape = f"{groups}x{s.rollouts} rows, checkpointing {'on' if ckpt else 'off'}"
    modes = [("fp32", "float32", "highest"), ("TF32", "float32", "high"), ("bf16", "bfloat16", "high")]
    policy: LoraPolicy | None = None
    start: dict[str, torch.Tensor] = {}
    for mode, dtype, matmul in modes:
        if ck.out_of_time(f"{name} {mode}"):
            continue
        if policy is None or policy.dtype != getattr(torch, dtype):
            policy = None
            free_memory()
            policy = LoraPolicy(model_dir, device=str(ck.device), dtype=dtype)
            start = lora_state(policy)
        else:
            restore_lora(policy, start)  # every mode's first step from the same adapter
        torch.set_float32_matmul_precision(matmul)  # after the policy, which turns TF32 on for CUDA
        trainer = GRPOTrainer(policy, ChatFormat(policy.tokenizer))
        seconds: list[float] = []
        peaks: list[float] = []
        nll = math.nan
        tokens = 0.0
        for i in range(s.warmup + s.steps):
            reset_peak(ck.device)
            t0 = time.perf_counter()
            _, metrics = trainer.step(data, config)
            synchronize(ck.device)
            if i == 0:
                nll, tokens = metrics["engine_trainer_logprob_gap"], metrics["trained_tokens"]
            if i >= s.warmup:
                seconds.append(time.perf_counter() - t0)
                peaks.append(peak_gib(ck.device) or math.nan)
        step = statistics.median(seconds)
        note = f"{shape}; {tokens:.0f} trained tokens" + (
            "" if ck.cuda or mode != "TF32" else "; TF32 is CUDA's"
        )
        ck.add(f"{name} {mode}: train step", step, "s/step", True, note)
        if ck.cuda:
            ck.add(f"{name} {mode}: peak memory", max(peaks), "GiB", None, "weights included")
        ck.add(f"{name} {mode}: loss (NLL, 1st step)", nll, "nats", math.isfinite(nll))
        ck.say(f"{name} {mode}: {step:.3f} s/step, NLL {nll:.4f}")
        del trainer


def section_precision(ck: Check) -> None:
    from journeyman.policy.precision import resolve_precision

    assert ck.base_dir is not None
    chosen = resolve_precision(None, ck.device)
    ck.add("default precision here", chosen.dtype + (" + TF32" if chosen.tf32 else ""), ok=True)
    precision_steps(ck, "base", ck.base_dir, ck.sizes.groups)


def section_wide(ck: Check, layers: int) -> None:
    path = ck.wide_dir(layers)
    layers = int(json.loads((path / "config.json").read_text())["num_hidden_layers"])
    precision_steps(ck, f"7B-width {layers}L", path, ck.sizes.wide_groups)


def section_checkpointing(ck: Check, layers: int) -> None:
    import long_rows  # bench/, on sys.path as this script's folder
    from journeyman.backends.memory_plan import Layout, TrainingSetup, plan_memory

    path = ck.wide_dir(layers)
    config = json.loads((path / "config.json").read_text())
    device = ck.device.type
    dtype = "bfloat16" if ck.cuda else "float32"
    largest = max(ck.sizes.ckpt_tokens)
    for tokens in ck.sizes.ckpt_tokens:
        cases = [(False, False), (True, False)] + ([(True, True)] if ck.cuda and tokens == largest else [])
        if ck.cuda and not ck.out_of_time(f"{tokens} tokens: warm-up"):
            with contextlib.suppress(torch.cuda.OutOfMemoryError):  # the case itself will say so
                long_rows.measure(path, tokens, True, False, device)  # compiles this length's kernels
            free_memory()
        for ckpt, offload in cases:
            what = f"{tokens} tokens, checkpointing {'on' if ckpt else 'off'}" + (
                ", offload" if offload else ""
            )
            if ck.out_of_time(what):
                continue
            try:
                r = long_rows.measure(path, tokens, ckpt, offload, device)
            except torch.cuda.OutOfMemoryError as e:
                ck.add(
                    what, "out of memory", ok=None if not ckpt else False, note=str(e).splitlines()[0][:120]
                )
                free_memory()
                continue
            free_memory()
            setup = TrainingSetup(
                dtype=dtype,
                max_seq_len=tokens,
                micro_batch_tokens=tokens,
                gradient_checkpointing=ckpt,
                offload_activations=offload,
            )
            plan = plan_memory(config, setup, Layout(device="cuda"), model="7B-width", suggest=False)
            estimate = (
                f"plan's estimate {(plan.activations + plan.head_logits + plan.gradients) / 1e9:.2f} GB"
            )
            if not ck.cuda:  # one process's peak RSS is not per case: bench/long_rows.py runs each alone
                ck.add(f"{what}: time", r["seconds"], "s", True, estimate)
                continue
            ck.add(f"{what}: time", r["seconds"], "s", True, "compiled in a warm-up call")
            ck.add(f"{what}: step memory", r["peak_step_gb"], "GB", None, estimate)
            ck.say(f"{what}: {r['seconds']:.2f} s, {r['peak_step_gb']:.2f} GB")


def section_packed(ck: Check) -> None:
    import packed_attention_check

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # equality in fp32, not TF32's 10 bits
    # dry: its rows carry a 600-token prompt whatever the size asked; toy rows of the same shape
    shape = packed_attention_check.TOY if ck.dry else packed_attention_check.AGENT
    try:
        results = packed_attention_check.check(
            list(ck.sizes.packed_tokens), ck.sizes.packed_width, ck.device, torch.float32, 8192, shape
        )
    finally:
        torch.set_float32_matmul_precision(before)
    for r in results:
        if r["way"] == "rows":  # the reference the gaps are taken against
            if r["grad"]:
                ck.add(f"{r['tokens']} tok rows (reference): fwd+bwd", r["seconds"], "s", True)
            continue
        where = f"{r['tokens']} tok {r['way']}{' +grad' if r['grad'] else ''}"
        gap = r["logprob_gap"]
        ck.add(f"{where}: logprob max|diff| vs rows", gap, "", gap <= LOGPROB_TOLERANCE)
        if r["grad"]:
            g = r["grad_gap"]
            ck.add(f"{where}: LoRA grad rel. diff vs rows", g, "", g <= GRAD_TOLERANCE)
            ck.add(
                f"{where}: fwd+bwd",
                r["seconds"],
                "s",
                True,
                f"peak {r['peak_gib']:.2f} GiB" if ck.cuda else "",
            )
    flex = any(r["way"] == "flex" and r["grad"] for r in results)
    if not flex:
        ck.add("flex with grad", "not run", ok=None, note="torch's FlexAttention has no backward off CUDA")


_CHILD = r"""
import json, sys
n, device = int(sys.argv[1]), sys.argv[2]
if device == "cuda":
    import torch
    torch.cuda.init()
    free0 = torch.cuda.mem_get_info()[0]
    block = torch.empty(n, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
else:
    block, free0, free1 = bytearray(n), None, None
print(json.dumps({"allocated": n, "free_before": free0, "free_after": free1}))
"""


def section_handoff(ck: Check) -> None:
    from journeyman.chat.formats import ChatFormat
    from journeyman.data.config import TrainConfig
    from journeyman.engine import handoff
    from journeyman.errors import WakeMemoryError
    from journeyman.policy.lora import LoraPolicy
    from journeyman.training.trainer import GRPOTrainer

    assert ck.base_dir is not None
    n = ck.sizes.handoff_tokens
    policy = LoraPolicy(ck.base_dir, device=str(ck.device))
    vocab = int(policy.model.get_base_model().config.vocab_size)
    data = agent_groups(vocab, 1, 2, 512 if ck.cuda else 16, (n, n))
    # checkpointing off: the step leaves its activations' blocks in the allocator's cache
    config = TrainConfig(max_seq_len=n + 600, gradient_checkpointing=False, learning_rate=1e-5)
    t0 = time.perf_counter()
    GRPOTrainer(policy, ChatFormat(policy.tokenizer)).step(data, config)
    synchronize(ck.device)
    ck.add(f"train step, 2 rows of {n} tokens", time.perf_counter() - t0, "s", True, "checkpointing off")
    before = handoff.cuda_memory()
    returned = handoff.return_cached_memory()
    after = handoff.cuda_memory()
    if before is None or after is None:
        ck.add("cached memory returned", returned / GiB, "GiB", True, f"{ck.device.type}: nothing to return")
        need = 64 << 20  # the plumbing only: a host allocation in the second process
    else:
        ck.add(
            "free before the return",
            before.free_bytes / GiB,
            "GiB",
            None,
            f"reserved here {before.reserved_here / GiB:.2f} GiB",
        )
        ck.add("cached memory returned", returned / GiB, "GiB", returned > 0)
        ck.add(
            "free after the return",
            after.free_bytes / GiB,
            "GiB",
            None,
            f"reserved here {after.reserved_here / GiB:.2f} GiB",
        )
        # what a woken engine could claim now: all that is free, less its own context
        need = max(0, after.free_bytes - CHILD_CONTEXT_BYTES - handoff.WAKE_HEADROOM_BYTES)
        try:  # the named refusal: against the reading before the return
            handoff.check_fits("kv_cache", need, lambda: before)
            ck.add(
                "check_fits before the return", "passes", ok=None, note="the step cached too little to matter"
            )
        except WakeMemoryError as e:
            ck.add("check_fits before the return", "refused", ok=True, note=str(e)[:160])
        handoff.check_fits("kv_cache", need, handoff.cuda_memory)  # and passes now
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(need), ck.device.type],
        capture_output=True,
        text=True,
        timeout=max(30.0, ck.time_left()),
        check=False,
    )
    if out.returncode != 0:
        ck.add(
            "wake-sized allocation, 2nd process",
            need / GiB,
            "GiB",
            False,
            out.stderr.strip().splitlines()[-1][:160],
        )
        return
    child = json.loads(out.stdout.strip().splitlines()[-1])
    note = "host memory (no CUDA)"
    if child["free_before"] is not None:
        note = f"free there {child['free_before'] / GiB:.2f} -> {child['free_after'] / GiB:.2f} GiB"
        if before is not None:
            note += f"; {max(0, need - before.free_bytes) / GiB:.2f} GiB more than was free before the return"
    ck.add("wake-sized allocation, 2nd process", need / GiB, "GiB", True, note)


def section_decode(ck: Check) -> None:
    """Decode tokens/s of the in-process engine at each row count, its step run eagerly and at fixed
    shapes (replayed as CUDA graphs on CUDA; `engine/decode_graph.py`), and how far the two modes'
    greedy logprobs are apart."""
    from journeyman.engine.base import Sample, SamplingParams
    from journeyman.engine.torch_engine import TorchEngine
    from journeyman.policy.lora import LoraPolicy

    assert ck.base_dir is not None
    s = ck.sizes
    policy = LoraPolicy(ck.base_dir, device=str(ck.device))
    vocab = int(policy.model.get_base_model().config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prompts = {
        n: [torch.randint(3, vocab, (s.decode_prompt,), generator=gen).tolist() for _ in range(n)]
        for n in s.decode_rows
    }
    greedy: dict[str, list[Sample]] = {}
    dtype = str(policy.dtype).removeprefix("torch.")

    async def rows(
        engine: TorchEngine, n: int, tokens: int, temperature: float = 1.0
    ) -> tuple[list[Sample], float]:
        params = SamplingParams(max_tokens=tokens, temperature=temperature)
        t0 = time.perf_counter()
        out = await asyncio.gather(*(engine.generate(p, params) for p in prompts[n]))
        return [x for samples in out for x in samples], time.perf_counter() - t0

    async def run(engine: TorchEngine, mode: str) -> None:
        label = "replayed" if mode == "fixed" and ck.cuda else mode
        for n in s.decode_rows:
            if ck.out_of_time(f"{label}: {n} rows"):
                continue
            await rows(engine, n, s.decode_tokens)  # warm-up: the same shapes (and captures)
            samples, seconds = await rows(engine, n, s.decode_tokens)
            tokens = sum(len(x.token_ids) for x in samples)
            ck.add(
                f"{label}: {n} rows x {s.decode_tokens} tokens",
                tokens / seconds,
                "tok/s",
                tokens == n * s.decode_tokens,
                f"{dtype}, prompt {s.decode_prompt}, prefill included",
            )
            ck.say(f"decode {label} {n} rows: {tokens / seconds:.0f} tok/s")
        if not ck.out_of_time(f"{label}: greedy"):
            greedy[mode] = (await rows(engine, min(s.decode_rows), s.decode_tokens, temperature=0.0))[0]

    for mode in ("eager", "fixed"):
        engine = TorchEngine(policy, stop_ids=set(), max_batch_rows=max(s.decode_rows), decode=mode)  # pyright: ignore[reportArgumentType]
        try:
            asyncio.run(run(engine, mode))
            graphs = engine.runner.graphs
            if mode == "fixed" and graphs is not None:
                ck.add(
                    "graphs captured / steps replayed",
                    f"{graphs.captures} / {graphs.replays}",
                    ok=graphs.failure is None,
                    note=graphs.failure or ("" if ck.cuda else "no CUDA: the fixed-shape step runs eagerly"),
                )
        finally:
            engine.close()
            engine.join(10.0)
    if len(greedy) == 2:  # logprobs compared up to each pair's first differing token
        pairs = list(zip(greedy["eager"], greedy["fixed"], strict=True))
        same = sum(x.token_ids == y.token_ids for x, y in pairs)
        gaps = [0.0]
        for x, y in pairs:
            for t, u, p, q in zip(x.token_ids, y.token_ids, x.logprobs, y.logprobs):  # noqa: B905
                if t != u:
                    break
                gaps.append(abs(p - q))
        judged = dtype == "float32"  # bf16 sums differ with the batch shape; reported, not judged
        ck.add(
            "greedy rows equal, eager vs fixed",
            f"{same}/{len(pairs)}",
            ok=same == len(pairs) if judged else None,
        )
        ck.add(
            "greedy logprob max|diff|, eager vs fixed",
            max(gaps),
            "",
            max(gaps) <= 1e-4 if judged else None,
            dtype,
        )


def section_grpo(ck: Check) -> None:
    import grpo_step

    if ck.base_is_random and not ck.dry:
        ck.add(
            "journeyman vs TRL",
            "not available",
            ok=None,
            note="needs real weights: the task's reward "
            "reads the sampled text (pass --base-model with SmolLM2-135M-Instruct's files)",
        )
        return
    saved = (grpo_step.PROMPTS, grpo_step.GROUP, grpo_step.MAX_TOKENS)
    if ck.sizes.grpo_task is not None:
        grpo_step.PROMPTS, grpo_step.GROUP, grpo_step.MAX_TOKENS = ck.sizes.grpo_task
    steps = ck.sizes.grpo_steps
    root = Path(tempfile.mkdtemp(prefix="grpo-", dir=ck.work))
    setting = f"{grpo_step.PROMPTS}x{grpo_step.GROUP} rollouts, {grpo_step.MAX_TOKENS} tokens, {steps} steps"
    try:
        with embedded_as(ck):
            train: list[float] = []
            secs, _ = asyncio.run(
                grpo_step.journeyman_steps(steps, root / "jm", bf16=False, train_seconds=train)
            )
            ours = statistics.median(secs[1:] or secs)
            ck.add("journeyman fp32: step", ours, "s/step", True, f"{setting}; first {secs[0]:.2f} s")
            ck.add("journeyman fp32: train half", statistics.median(train[1:] or train), "s/step", True)
            free_memory()
            if importlib.util.find_spec("trl") is None:
                ck.add(
                    "TRL GRPOTrainer fp32",
                    "not available",
                    ok=None,
                    note="TRL is not installed (uv sync --group bench)",
                )
                return
            if ck.out_of_time("TRL GRPOTrainer fp32"):
                return
            trl_secs, _ = grpo_step.trl_steps(steps, root)
            theirs = statistics.median(trl_secs[1:] or trl_secs)
            ck.add("TRL GRPOTrainer fp32: step", theirs, "s/step", True, setting)
            ck.add("speed-up over TRL", theirs / ours, "x", True)
    finally:
        grpo_step.PROMPTS, grpo_step.GROUP, grpo_step.MAX_TOKENS = saved


def section_vllm(ck: Check) -> None:
    import vllm_wake_check

    reason = vllm_wake_check.skip_reason(ck.vllm_python)
    if reason is not None:
        ck.add("wake check", "skipped", ok=None, note=reason)
        return
    with embedded_as(ck):
        result = vllm_wake_check.wake_check(ck.vllm_python, sleep_level=2, max_tokens=4 if ck.dry else 16)
    for name, ok in result.checks.items():
        ck.add(name, "pass" if ok else "FAIL", ok=ok)
    for stage, seconds in result.wake_seconds.items():
        ck.add(f"wake stage {stage}", seconds, "s", True)


# -- the run ----------------------------------------------------------------------------------------

SECTIONS: dict[int, str] = {
    1: "1 precision",
    2: "2 7B-width",
    3: "3 checkpointing",
    4: "4 packed attention",
    5: "5 memory handoff",
    6: "6 decode",
    7: "7 GRPO vs TRL",
    8: "8 vLLM wake",
}


def run_section(ck: Check, number: int, fn: Callable[[Check], None]) -> None:
    ck.section = SECTIONS[number]
    ck.section_deadline = time.monotonic() + ck.sizes.budgets[number]
    if ck.unavailable is not None:
        ck.add(
            "not available", ck.unavailable, ok=False, note="carry journeyman's dependencies: docs/scale.md"
        )
        return
    if ck.deadline - time.monotonic() <= 0:
        ck.add("skipped", "the run's time budget is spent", ok=None)
        return
    ck.say(f"section {ck.section} ...")
    t0, cpu0 = time.perf_counter(), time.process_time()
    matmul = torch.get_float32_matmul_precision()
    try:
        fn(ck)
    except Exception as e:  # a failed section is a row; the others still run
        traceback.print_exc()
        ck.add("error", f"{type(e).__name__}: {e}".splitlines()[0][:200], ok=False)
    finally:
        torch.set_float32_matmul_precision(matmul)
        free_memory()
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    ck.add("elapsed", elapsed, "s", None, f"budget {ck.sizes.budgets[number]:.0f} s; CPU time {cpu:.1f} s")
    ck.say(f"section {ck.section}: {elapsed:.1f} s")


def _finite(x: Any) -> Any:
    """`x` with NaN and infinities as null: the JSON file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _figure(x: float | str | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.4g}"
    return str(x)


def table(rows: list[Result]) -> str:
    """The rows as aligned columns: section, setting, figure, unit, ok, and the note."""
    head = ("section", "setting", "figure", "unit", "ok", "note")
    cells = [
        (
            r.section,
            r.setting,
            _figure(r.figure)[:48],
            r.unit,
            {True: "yes", False: "FAIL", None: ""}[r.ok],
            r.note[:120],
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
    lines = [
        " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *cells]
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="every section at toy size, on any device")
    ap.add_argument("--json", type=Path, default=Path("gpu_check.json"), help="write the rows here")
    ap.add_argument(
        "--base-model", help="a local HF model directory (default: embedded, else random weights)"
    )
    ap.add_argument("--wide-layers", type=int, default=4, help="decoder layers of the 7B-width model")
    ap.add_argument("--sections", default="1,2,3,4,5,6,7,8", help="which sections, e.g. 1,3")
    ap.add_argument("--budget-s", type=float, default=570.0, help="the whole run's time budget")
    ap.add_argument("--device", help="default: cuda when there is one, else cpu")
    ap.add_argument("--vllm-python", help="vLLM's interpreter for section 8 (VLLMConfig.python)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    chosen = {int(x) for x in args.sections.split(",") if x.strip()}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ck = Check(device, args.dry_run, DRY if args.dry_run else REAL, Path(tmp), start + args.budget_s)
        ck.vllm_python = args.vllm_python
        ck.section = "0 setup"
        name = (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"cpu, {torch.get_num_threads()} threads"
        )
        ck.add("device", name)
        ck.add("torch", torch.__version__)
        try:
            import journeyman  # noqa: F401  (its dependencies: pydantic, openai, ...)
            import peft
            import transformers

            ck.add("transformers / peft", f"{transformers.__version__} / {peft.__version__}")
        except ImportError as e:
            ck.unavailable = f"journeyman does not import here: {e}"
            ck.add("journeyman", "not available", ok=False, note=str(e))
        else:
            choose_base(ck, args.base_model)
            ck.add("base model", ck.base_label, ok=True, note=str(ck.base_dir))
        ck.say(f"{name}; base model: {ck.base_label or '-'}")
        fns: dict[int, Callable[[Check], None]] = {
            1: section_precision,
            2: lambda c: section_wide(c, args.wide_layers),
            3: lambda c: section_checkpointing(c, args.wide_layers),
            4: section_packed,
            5: section_handoff,
            6: section_decode,
            7: section_grpo,
            8: section_vllm,
        }
        for number, fn in fns.items():
            if number in chosen:
                run_section(ck, number, fn)
        total = time.monotonic() - start
        ck.section = "total"
        ck.add(
            "elapsed",
            total,
            "s",
            total <= args.budget_s + 30 or args.dry_run,
            f"budget {args.budget_s:.0f} s",
        )
    print("\n" + table(ck.rows), flush=True)
    report = {
        "device": name,
        "dry_run": args.dry_run,
        "base_model": ck.base_label,
        "sections": sorted(SECTIONS[n] for n in chosen if n in SECTIONS),
        "rows": [asdict(r) for r in ck.rows],
    }
    args.json.write_text(json.dumps(_finite(report), indent=1))
    print(f"\nwrote {args.json}")
    return 1 if any(r.ok is False for r in ck.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
