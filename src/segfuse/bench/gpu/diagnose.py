"""Where a transformers member's bare decode runs fastest: the GPU check's diagnosis.

The bare loop is the leader's cached greedy decode with nothing else done per token: the prompt read once
(not timed), then one ``Weights.forward`` per token on a ``DynamicCache``, the next token the row's argmax.
It is timed (a) on the calling thread, (b) on a brand-new thread each time, (c) on a brand-new thread with
cuDNN's scaled-dot-product attention switched off (and back on after), and (d) on the member's own compute
thread (``member.compute(fn, *args)``) where the member has one. The variants run interleaved, a
repetition of each in turn, after one untimed loop; the report gives each one's median and spread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from ..speed.speeds import synchronizer
from ..speed.systems import spread, timed

if TYPE_CHECKING:
    from ...backends.transformers import TransformersMember


def bare_loop(member: TransformersMember, prompt: Sequence[int], tokens: int) -> float:
    """Seconds for `tokens` greedy decodes of one forward each, after the prompt (read, not timed)."""
    from transformers import DynamicCache

    weights, sync = member.weights, synchronizer(member)
    cache = DynamicCache()
    row = weights.forward(cache, prompt, range(len(prompt)), last_only=True)[-1]
    pos = len(prompt)
    sync()

    def loop() -> None:
        nonlocal row, pos
        for _ in range(tokens):
            token = int(row.argmax())
            row = weights.forward(cache, [token], [pos], last_only=True)[-1]
            pos += 1
        sync()

    return timed(loop)[0]


def in_new_thread(fn: Callable[[], float]) -> float:
    """`fn()` on a thread started for it alone; its value (its exception re-raised here)."""
    out: list[float] = []
    failed: list[BaseException] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # carried to the caller
            failed.append(exc)

    thread = threading.Thread(target=body, name="segfuse-diagnose")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


def with_cudnn_attention(on: bool) -> Callable[[Callable[[], float]], float]:
    """Run `fn()` on a new thread with cuDNN's SDPA kernel in torch's choice (`on`) or out of it, restored to
    what it was afterwards. (A CUDA transformers member leaves it out on loading: ``cudnn_attention_off``.)"""

    def run(fn: Callable[[], float]) -> float:
        import torch

        before = torch.backends.cuda.cudnn_sdp_enabled()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        torch.backends.cuda.enable_cudnn_sdp(on)
        try:
            return in_new_thread(fn)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(before)

    return run


def variants(member: TransformersMember) -> dict[str, Callable[[Callable[[], float]], float]]:
    """The places to run the loop, by the name the report gives them."""
    found: dict[str, Callable[[Callable[[], float]], float]] = {
        "main_thread": lambda fn: fn(),
        "new_thread": in_new_thread,
        "new_thread_cudnn_sdp": with_cudnn_attention(True),
        "new_thread_no_cudnn_sdp": with_cudnn_attention(False),
    }
    compute: Any = getattr(member, "compute", None)
    if callable(compute):
        found["compute_thread"] = lambda fn: float(compute(fn))
    return found


def diagnose(member: TransformersMember, prompt: Sequence[int], tokens: int = 64, reps: int = 3) -> dict[str, Any]:
    """Each variant's seconds for the bare loop (median, min, max) and its milliseconds per token."""
    loop = partial(bare_loop, member, prompt, tokens)
    places = variants(member)
    loop()  # first-call costs (allocations, kernel plans) out of the timings
    seconds: dict[str, list[float]] = {name: [] for name in places}
    for _ in range(reps):
        for name, place in places.items():
            seconds[name].append(place(loop))
    report: dict[str, Any] = {"member": member.name, "tokens": tokens, "prompt_tokens": len(prompt)}
    for name, values in seconds.items():
        report[name] = {**spread(values), "ms_per_token": 1000 * spread(values)["median"] / tokens}
    if "compute_thread" not in places:
        report["compute_thread"] = "skipped: the member has no compute thread (member.compute)"
    return report
