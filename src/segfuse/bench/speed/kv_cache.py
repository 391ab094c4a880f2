"""KV-cache types side by side: one llama.cpp member loaded with each cache type (``type_k``/``type_v``), the bytes
one token's cells take (llama.cpp's own state of a sequence) and the answer's decode speed, after a short prompt
and after a long one (attention reads the whole cache per token, so its type matters more as the context fills).

    python -m segfuse.bench.speed.kv_cache --model qwen2.5-coder-0.5b --runs 3
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import llama_cpp as lc

from ...ensemble import Ensemble
from ...types import DoneEvent, Message, RoundEvent

CACHES = {"f16": "", "q8_0": ",type_k=q8_0,type_v=q8_0"}
LONG_WORDS = 1200  # about 1,200 tokens of prompt before the answer


def state_per_token(member: Any, tokens: int = 256) -> float:
    """Bytes of llama.cpp's state of one sequence per token, `tokens` tokens in it (the cells' K and V)."""
    context = member.context
    ids = member.vocab.tokenize_plain("The sea " * tokens)[:tokens]
    context.decode(ids, list(range(len(ids))), [0] * len(ids), [False] * (len(ids) - 1) + [True])
    size = int(lc.llama_state_seq_get_size(context._ctx, 0))
    context.clear()
    return size / len(ids)


def decode_speed(ensemble: Ensemble, words: int, max_tokens: int) -> float:
    """Answer tokens per second after a prompt of `words` words (greedy, to the budget), from the end of the
    first round (the prompt read, the first segment drafted) to the answer's end: the decode alone."""
    prompt = [Message("user", "Repeat after me. " + " ".join(["sea"] * words) + " Now count to one hundred.")]
    first_at, first_tokens = 0.0, 0
    for event in ensemble.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        if isinstance(event, RoundEvent) and not first_tokens:
            first_at = time.perf_counter()
            first_tokens = event.record.candidates[event.record.winner_index].n_tokens
        elif isinstance(event, DoneEvent):
            return (event.result.stats.tokens - first_tokens) / (time.perf_counter() - first_at)
    raise RuntimeError("the answer did not end")


def measure(model: str, cache: str, threads: int, max_tokens: int) -> dict[str, Any]:
    ensemble = Ensemble([f"{model}#{cache}{CACHES[cache]}"], threads=threads, n_ctx=2048, slots=1, prefix_cache_cells=0)
    try:
        member = ensemble.members[0]
        decode_speed(ensemble, 8, 16)  # a warm-up: the first answer after a load is slower
        return {
            "cache": cache,
            "bytes_per_token": state_per_token(member),
            "short_tok_s": decode_speed(ensemble, 8, max_tokens),
            "long_tok_s": decode_speed(ensemble, LONG_WORDS, max_tokens),
        }
    finally:
        ensemble.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    for run in range(args.runs):
        for cache in CACHES:  # alternated, so that a busy moment of the machine falls on both
            row = {"run": run + 1, **measure(args.model, cache, args.threads, args.max_tokens)}
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
