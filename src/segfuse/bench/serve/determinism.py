"""Does the same greedy request give the same text on a busy server? With and without ``deterministic``.

``python -m segfuse.bench.serve.determinism --rounds 8 [--targets 9] [--max-tokens 32] [--threads N] [--out FILE]``
starts ``segfuse serve`` (the embedded members, 4 generations at once, the prefix cache on), asks each
*target* (a one-message chat, greedy) once to fill the cache, then runs rounds. Each round sends, at once,
in a seeded random order with staggered starts:

- every target twice: once with ``{"deterministic": true}`` in the ``segfuse`` object, once without
  (each a cache hit of its own earlier rounds, and of the chat template's shared head);
- a system prompt with one of several questions (prefixes shared with each other);
- a target's conversation continued (its prompt and first answer, then a follow-up);
- an unrelated prompt.

It counts, per target and way, the texts that differ from that target's most common one, and compares
the two ways' cost in the same rounds: the client's latency (queueing included) and the server's tokens
per second of generation (``stats``). The first round is left out of the cost: a member's first
deterministic requests open their contexts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.load import PROMPTS
from ..common.machine import git, machine
from ..common.processes import SegfuseServer, segfuse_server

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

TARGETS = ("Describe the sea.", *PROMPTS)
SYSTEM = "You are a careful assistant. Answer in plain words, in two sentences at most."
OTHER_QUESTIONS = ("Describe a forest.", "Describe the desert.", "Describe a mountain.", "Describe the sky.")
UNRELATED = ("How do I boil an egg?", "What is the tallest mountain in Africa?", "Write a limerick about a dog.")
FOLLOW_UP = "Say it again in fewer words."
API_KEY = "bench-key"


@dataclass
class Reply:
    kind: str
    target: str | None
    text: str
    latency_s: float  # send to answer, queueing included
    tokens: int
    generation_s: float  # the server's stats.total_s: generation alone

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.generation_s if self.generation_s > 0 else 0.0


Messages = list["ChatCompletionMessageParam"]
Request = tuple[str, str | None, Messages, bool | None]  # kind, target, messages, deterministic


def chat(server: SegfuseServer, request: Request, max_tokens: int) -> Reply:
    from openai import OpenAI

    kind, target, messages, deterministic = request
    client = OpenAI(base_url=server.api, api_key=server.api_key, max_retries=0, timeout=600)
    extra = {"segfuse": {"deterministic": deterministic}} if deterministic is not None else None
    t0 = time.perf_counter()
    reply = client.chat.completions.create(
        model="segfuse", messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    latency = time.perf_counter() - t0
    stats = (reply.model_extra or {})["segfuse"]["stats"]
    return Reply(kind, target, reply.choices[0].message.content or "", latency, stats["tokens"], stats["total_s"])


def user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


def round_requests(index: int, targets: tuple[str, ...], first: dict[str, str]) -> list[Request]:
    """One round's requests: every target both ways, and the other traffic."""
    requests: list[Request] = [
        (kind, t, user(t), flag) for t in targets for kind, flag in (("deterministic", True), ("default", None))
    ]
    continued = targets[index % len(targets)]
    sibling: Messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": OTHER_QUESTIONS[index % len(OTHER_QUESTIONS)]},
    ]
    requests += [
        ("shared system prompt", None, sibling, None),
        (
            "continued",
            None,
            [*user(continued), {"role": "assistant", "content": first[continued]}, *user(FOLLOW_UP)],
            None,
        ),
        ("unrelated", None, user(UNRELATED[index % len(UNRELATED)]), None),
    ]
    return requests


def send_all(server: SegfuseServer, requests: list[Request], max_tokens: int, rng: random.Random) -> list[Reply]:
    """`requests` at once, in a random order, each after a random delay of up to 0.6 s."""
    requests = list(requests)
    rng.shuffle(requests)
    delays = [rng.uniform(0, 0.6) for _ in requests]

    def send(i: int) -> Reply:
        time.sleep(delays[i])
        return chat(server, requests[i], max_tokens)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(send, range(len(requests))))


def summary(answers: list[Reply]) -> dict[str, Any]:
    """Per target, the texts and how many differ from its most common one; and the totals."""
    per_target: dict[str, Counter[str]] = {}
    for a in answers:
        per_target.setdefault(a.target or "", Counter())[a.text] += 1
    differing = {t: sum(c.values()) - c.most_common(1)[0][1] for t, c in per_target.items()}
    return {
        "requests": len(answers),
        "differing": sum(differing.values()),
        "targets_with_several_texts": sum(len(c) > 1 for c in per_target.values()),
        "per_target": {t: {"differing": differing[t], "texts": dict(c)} for t, c in per_target.items()},
    }


def cost(answers: list[Reply]) -> dict[str, float]:
    return {
        "latency_s_median": round(statistics.median(a.latency_s for a in answers), 3),
        "tokens_per_s_median": round(statistics.median(a.tokens_per_s for a in answers), 2),
        "tokens_per_s_mean": round(statistics.fmean(a.tokens_per_s for a in answers), 2),
        "tokens_mean": round(statistics.fmean(a.tokens for a in answers), 1),
    }


def run(rounds: int, targets: tuple[str, ...], max_tokens: int, threads: int | None, seed: int) -> dict[str, Any]:
    config: dict[str, dict[str, Any]] = {
        "server": {"api_key": API_KEY, "max_concurrent": 4, "queue_size": 64},
        "members": {"threads": threads} if threads else {},
        "defaults": {"max_tokens": max_tokens, "temperature": 0.0},
    }
    rng = random.Random(seed)
    rounds_of: list[dict[str, list[Reply]]] = []
    with tempfile.TemporaryDirectory() as tmp, segfuse_server(Path(tmp), "determinism", config) as server:
        warm = send_all(server, [("warm-up", t, user(t), None) for t in targets], max_tokens, rng)
        first = {a.target: a.text for a in warm if a.target}
        for index in range(rounds):
            kinds: dict[str, list[Reply]] = {}
            for answer in send_all(server, round_requests(index, targets, first), max_tokens, rng):
                kinds.setdefault(answer.kind, []).append(answer)
            rounds_of.append(kinds)
            print(
                f"round {index + 1}/{rounds}: "
                + ", ".join(
                    f"{kind} {sum(a.target is not None and a.text != first[a.target] for a in kinds[kind])} "
                    "other than the warm-up's"
                    for kind in ("deterministic", "default")
                ),
                flush=True,
            )
    det = [a for r in rounds_of for a in r["deterministic"]]
    default = [a for r in rounds_of for a in r["default"]]
    later = rounds_of[1:] or rounds_of
    return {
        "machine": machine(),
        "git": git(),
        "rounds": rounds,
        "targets": list(targets),
        "max_tokens": max_tokens,
        "threads": threads,
        "seed": seed,
        "deterministic": summary(det),
        "default": summary(default),
        "cost": {kind: cost([a for r in later for a in r[kind]]) for kind in ("deterministic", "default")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--targets", type=int, default=len(TARGETS), help=f"how many of the {len(TARGETS)} targets")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--threads", type=int, default=None, help="llama.cpp threads per member (default: the server's)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the order and staggering of each round's requests")
    parser.add_argument("--out", default="runs/determinism.json")
    args = parser.parse_args()
    report = run(args.rounds, TARGETS[: args.targets], args.max_tokens, args.threads, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for kind in ("deterministic", "default"):
        s, c = report[kind], report["cost"][kind]
        print(
            f"{kind}: {s['differing']} of {s['requests']} texts differ from their target's most common one "
            f"({s['targets_with_several_texts']} targets with several); median latency {c['latency_s_median']} s, "
            f"median {c['tokens_per_s_median']} tok/s"
        )


if __name__ == "__main__":
    main()
