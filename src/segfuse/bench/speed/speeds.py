"""A member's raw speeds, which price the floor (the work plain fusion cannot avoid), and the Hugging Face
``generate`` baseline of a transformers member.

Raw speeds are three figures per member, measured through the backend's own decode with nothing else done
per token, at a context as long as the mid-answer context: seconds per prompt token (one prefill), per
decoded token (one token at a time, the median of :data:`DECODES`) and per batched token (a batch of the
run's mean verification size after the prefix). llama.cpp members run them on their own context's spare
sequences, transformers members through ``Weights.forward`` on a fresh ``DynamicCache``, the GPU
synchronised around every timing. Each backend's module is looked up among those already imported: a
member of a backend never imported cannot be here, and a machine without llama.cpp never loads it.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from ...backends.base import Member
from ...errors import SegfuseError
from ...types import Message
from .systems import timed

if TYPE_CHECKING:
    from ...backends.llama_cpp import LlamaCppMember
    from ...backends.transformers import TransformersMember

DECODES = 16  # one-token decodes timed (their median)
PREFILL_CHUNK = 512  # tokens per forward while growing a transformers context


def backend_of(member: Member) -> str:
    """``llama_cpp`` or ``transformers``: the backends whose raw speeds the benchmark measures."""
    for backend, cls in (("llama_cpp", "LlamaCppMember"), ("transformers", "TransformersMember")):
        module = sys.modules.get(f"segfuse.backends.{backend}.member")
        if module is not None and isinstance(member, getattr(module, cls)):
            return backend
    raise SegfuseError(
        f"{member.name}: the benchmark times llama.cpp and transformers members only",
        "name GGUF models or transformers: members (no remote: or ray: members)",
    )


def check_members(members: Sequence[Member]) -> None:
    """Refuse, before anything is timed, members whose raw speeds cannot be measured."""
    for member in members:
        backend_of(member)


def member_speeds(
    member: Member, messages: Sequence[Message], context: int, batch: int, repeats: int = 5
) -> dict[str, float]:
    """Seconds per prompt token (one prefill), per decoded token, and per batched token (see the module)."""
    if backend_of(member) == "llama_cpp":
        return llama_speeds(cast("LlamaCppMember", member), messages, context, batch, repeats)
    return transformers_speeds(cast("TransformersMember", member), messages, context, batch, repeats)


def floor_seconds(counters: dict[str, dict[str, int]], speeds: dict[str, dict[str, float]]) -> float:
    """Price the fusion run's necessary work at the members' raw speeds."""
    total = 0.0
    for name, c in counters.items():
        if name not in speeds:  # a member that never started (standby) did no work
            continue
        s = speeds[name]
        total += c["prompt"] * s["prompt_s_per_token"]
        total += (c["draft"] + c["catch_up"]) * s["decode_s_per_token"]
        total += c["verify"] * s["batch_s_per_token"]
    return total


def _speeds(
    t_prompt: float, prompt_len: int, decodes: list[float], batches: list[float], batch: int
) -> dict[str, float]:
    return {
        "prompt_s_per_token": t_prompt / max(prompt_len, 1),
        "decode_s_per_token": statistics.median(decodes),
        "batch_s_per_token": statistics.median(batches) / batch,
        "batch_size": batch,
    }


# --- llama.cpp ------------------------------------------------------------------------


def llama_speeds(
    member: LlamaCppMember, messages: Sequence[Message], context: int, batch: int, repeats: int = 5
) -> dict[str, float]:
    """Raw llama.cpp decodes through the member's own context: the prompt in sequence 0, grown to `context`;
    the batch in sequence 1, a copy of it."""
    ctx = member.context
    session = member.open_session(member.prompt_tokens(messages), seed=0)  # a short prompt: it fits
    try:
        prompt_len = len(session.tokens)
        t_prompt, _ = timed(session.sync)
        filler = [session.tokens[-1]] * max(0, context - prompt_len)
        pos = prompt_len
        for start in range(0, len(filler), ctx.n_batch):  # grow the context to `context`
            chunk = filler[start : start + ctx.n_batch]
            ctx.decode(chunk, range(pos, pos + len(chunk)), [0] * len(chunk), [False] * len(chunk))
            pos += len(chunk)
        decodes = []
        for i in range(DECODES):
            dt, _ = timed(partial(ctx.decode, [filler[0] if filler else 0], [pos + i], [0], [True]))
            decodes.append(dt)
        ctx.seq_rm(0, pos, -1)
        batches = []
        for _ in range(repeats):
            ctx.seq_cp(0, 1, 0, pos)
            ids = [session.tokens[-1]] * batch
            dt, _ = timed(partial(ctx.decode, ids, range(pos, pos + batch), [1] * batch, [True] * batch))
            batches.append(dt)
            ctx.seq_rm(1, -1, -1)
    finally:
        session.close()
    return _speeds(t_prompt, prompt_len, decodes, batches, batch)


# --- transformers ---------------------------------------------------------------------


def synchronizer(member: Member) -> Callable[[], None]:
    """A call that waits for the member's GPU work queued so far (nothing to wait for on a CPU)."""
    if backend_of(member) != "transformers":
        return lambda: None
    import torch

    device = cast("TransformersMember", member).weights.input_device
    if device.type != "cuda":
        return lambda: None
    return partial(torch.cuda.synchronize, device)


def on_compute(member: Member) -> Callable[..., Any]:
    """Where the member's own calls compute: its compute thread (``member.compute(fn, *args)``) where it has
    one, else the calling thread."""
    compute = getattr(member, "compute", None)
    return compute if callable(compute) else (lambda fn, *args: fn(*args))


def transformers_speeds(
    member: TransformersMember, messages: Sequence[Message], context: int, batch: int, repeats: int = 5
) -> dict[str, float]:
    """Raw forward passes of the member's weights on a fresh cache, where its sessions compute."""
    prompt = member.prompt_tokens(messages)
    measure = partial(_forward_speeds, member, prompt, context, batch, repeats)
    speeds: dict[str, float] = on_compute(member)(measure)
    return speeds


def _forward_speeds(
    member: TransformersMember, prompt: list[int], context: int, batch: int, repeats: int
) -> dict[str, float]:
    from transformers import DynamicCache

    weights, sync = member.weights, synchronizer(member)

    def clocked(ids: Sequence[int], at: int, **kw: Any) -> float:
        sync()
        dt, _ = timed(lambda: (weights.forward(cache, ids, range(at, at + len(ids)), **kw), sync()))
        return dt

    cache = DynamicCache()
    t_prompt = clocked(prompt, 0, last_only=True)
    pos, token = len(prompt), prompt[-1]
    while pos < context:  # grow the context to `context`
        n = min(PREFILL_CHUNK, context - pos)
        weights.forward(cache, [token] * n, range(pos, pos + n), last_only=True)
        pos += n
    decodes = [clocked([token], pos + i, last_only=True) for i in range(DECODES)]
    _crop(cache, pos)
    mask = weights.block_mask(pos, 0, [batch])  # one candidate block after the prefix, as verification masks it
    batches = []
    for _ in range(repeats):
        batches.append(clocked([token] * batch, pos, mask=mask))
        _crop(cache, pos)
    return _speeds(t_prompt, len(prompt), decodes, batches, batch)


def _crop(cache: Any, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # negative: tokens to remove (old and new transformers alike)


def generate_seconds(member: Member, messages: Sequence[Message], length: int) -> float | None:
    """Hugging Face ``model.generate`` writing `length` greedy tokens from the member's prompt tokens (EOS held
    off to the end), on the member's compute thread; None for a member that is not a transformers one."""
    if backend_of(member) != "transformers":
        return None
    import torch
    from transformers import GenerationConfig

    weights = cast("TransformersMember", member).weights
    ids = torch.tensor([member.prompt_tokens(messages) or []], device=weights.input_device)
    eos = cast("TransformersMember", member).vocab.eog_ids
    config = GenerationConfig(  # type: ignore[no-untyped-call]  # untyped in transformers
        max_new_tokens=length, min_new_tokens=length, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
    )
    sync = synchronizer(member)

    def write() -> Any:
        out = weights.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        sync()
        return out

    def timed_write() -> Any:
        with torch.inference_mode():  # per thread: on the thread that writes
            return timed(write)

    sync()
    dt, out = on_compute(member)(timed_write)  # where the member's own sessions decode, as the default's do
    written = out.shape[1] - ids.shape[1]
    if written != length:
        raise RuntimeError(f"{member.name}: generate wrote {written} tokens, not {length}")
    return float(dt)
