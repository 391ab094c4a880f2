"""segfuse as an lm-evaluation-harness model named ``segfuse``.

Run lm-eval's own CLI through this module (console script ``segfuse-lm-eval``,
or ``python -m segfuse.eval.lm_eval_adapter``), which registers the model and adds
the local task configs (``segfuse_gsm8k``, ``segfuse_ifeval``, the multiple-choice group
``segfuse_bigbench_mc``: the files under ``../shared/data``, no hub access) before handing over::

    segfuse-lm-eval --model segfuse \\
        --model_args system=specfuse,max_tokens=256 --tasks segfuse_gsm8k --limit 20

(lm-eval has no plugin entry point: a plain ``lm_eval --model segfuse`` finds the
model only where this module was imported first, e.g. from Python with
``lm_eval.simple_evaluate(model=SegfuseLM(...), tasks=[...], task_manager=task_manager())``.)

model_args: ``models`` (members joined by ``|``; default the embedded three),
``system`` (any eval system: ``specfuse``, ``rerank``, ``member:NAME``),
``max_tokens`` (cap on each request's ``max_gen_toks``), ``temperature``
(default 0: greedy), ``seed``, ``window``, and every member option (MemberOptions: ``threads``,
``n_ctx``, ``gpu_layers``, ``prefix_cache_cells``, ...; ``prefix_cache_cells=0``: no prefix cache, as a
server started with ``--prefix-cache-cells 0``: the way to get the same greedy answers).
Any other key is refused with the list of these (a misspelt key would otherwise change nothing, silently).

Prompts: a request's context becomes one user message that each member renders
with its own chat template; with ``--apply_chat_template`` the harness's
messages are passed through the same way. ``until`` strings become stop strings.

Log-likelihood requests (multiple-choice and perplexity tasks): every member scores the
continuation under its own tokenizer (``segfuse.likelihood``) and the scores are pooled by
``rule``: ``loglinear`` (default) answers the weighted mean of the members' summed
log-probabilities, so lm-eval's ``acc`` compares whole continuations and ``acc_norm`` compares
them per character; ``mixture-byte`` / ``mixture-whole`` answer the log of the members' mean
probability of the choice, normalised over the choices that share the request's context.
``weights``: ``NAME:W|NAME:W`` (default uniform). ``system=member:NAME``: that member alone.
A continuation is greedy when it is every scoring member's greedy continuation.
With ``slots=N`` (or lm-eval's ``--batch_size N`` where ``slots`` is not given) each llama.cpp
member holds N sessions and scores N items' choices in one decode.
``loglikelihood_rolling`` scores a whole text after a newline (log-linear pool), up to the
members' window.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..member_options import MemberOptions, flag_fields
from ..types import Message
from .lm_eval_scoring import LikelihoodScoring, parse_rule
from .systems import ItemContext, RunSettings, get_system

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")
_CHAT_KEY = "segfuse_messages"
RUN_ARGS = ("models", "system", "max_tokens", "temperature", "seed", "window", "rule", "weights")
MODEL_ARGS = RUN_ARGS + tuple(flag_fields()) + ("slots",)  # and every member option
HARNESS_ARGS = ("batch_size", "max_batch_size", "device")  # lm-eval passes these to every model (batch_size: slots)


class ModelArgsError(ValueError):
    """A model_args key the segfuse model does not take."""


def task_manager() -> Any:  # lm_eval has no type information
    """An lm-eval TaskManager that also knows the local segfuse task configs."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


@register_model("segfuse")
class SegfuseLM(LM):  # type: ignore[misc]  # lm_eval has no type information: LM is Any
    """The ensemble (or any registered eval system) behind lm-eval's LM interface."""

    def __init__(
        self,
        models: str | None = None,
        system: str = "specfuse",
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int = 0,
        window: int = 10,
        rule: str = "loglinear",
        weights: str | None = None,
        **others: Any,
    ) -> None:
        super().__init__()
        from ..ensemble import Ensemble

        member_options = {k: others.pop(k) for k in list(others) if k in MODEL_ARGS}
        if "slots" not in member_options and str(others.get("batch_size", "")).isdigit():
            member_options["slots"] = max(int(others["batch_size"]), 1)  # lm-eval's batch: items scored at once
        unknown = sorted(set(others) - set(HARNESS_ARGS))
        if unknown:
            raise ModelArgsError(
                f"unknown model_args for the segfuse model: {', '.join(unknown)}; it takes {', '.join(MODEL_ARGS)}"
            )

        get_system(system)  # fail on a bad name before loading models
        rule_chosen = parse_rule(rule, weights)
        names = [m for m in str(models).split("|") if m] if models else None
        options = MemberOptions.build(member_options, where="model_args")  # lm-eval's values arrive typed or as text
        self.ensemble = Ensemble(names, **options.given())
        self.system = system
        self.scoring = LikelihoodScoring.build(self.ensemble, system, rule_chosen)
        self.settings = RunSettings(
            max_tokens=int(max_tokens),
            temperature=float(temperature),
            top_p=1.0 if float(temperature) <= 0 else 0.9,
            seed=int(seed),
            window=int(window),
        )

    @property
    def tokenizer_name(self) -> str:
        return "segfuse:" + "|".join(self.ensemble.names)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return "per-member"  # each member applies its own template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Keep the messages structured; each member renders them with its own template."""
        return json.dumps({_CHAT_KEY: chat_history})

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from tqdm import tqdm

        system = get_system(self.system)
        outputs: list[str] = []
        for request in tqdm(requests, disable=disable_tqdm, desc="segfuse"):
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or ()
            until = (until,) if isinstance(until, str) else tuple(until)
            limit = int(gen_kwargs.get("max_gen_toks") or self.settings.max_tokens)
            settings = RunSettings(
                **{**self.settings.__dict__, "max_tokens": min(limit, self.settings.max_tokens), "stop": until}
            )
            output = system(ItemContext(self.ensemble), to_messages(context), settings)
            outputs.append(output.text)
            self.cache_hook.add_partial("generate_until", request.args, output.text)
        return outputs

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Each (context, continuation): the pooled log-likelihood and whether it is greedy."""
        answers = self.scoring.loglikelihood([r.args for r in requests], disable_tqdm)
        for request, answer in zip(requests, answers):
            self.cache_hook.add_partial("loglikelihood", request.args, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's pooled log-likelihood as a whole (perplexity tasks)."""
        answers = self.scoring.rolling([r.args[0] for r in requests], disable_tqdm)
        for request, answer in zip(requests, answers):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, answer)
        return answers


def to_messages(context: str) -> list[Message]:
    """A harness context (plain text, or messages from apply_chat_template) as chat messages."""
    try:
        data = json.loads(context)
    except ValueError:
        data = None
    if isinstance(data, dict) and _CHAT_KEY in data:
        return [Message(m["role"], m["content"]) for m in data[_CHAT_KEY]]
    return [Message("user", context.strip())]


def main(argv: list[str] | None = None) -> None:
    """lm-eval's CLI with the `segfuse` model registered and the local tasks included."""
    from lm_eval.__main__ import cli_evaluate

    from .nltk_offline import ensure_punkt

    ensure_punkt()  # lm-eval's IFEval module looks for punkt_tab when imported
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("--include_path") for a in args):
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *args]  # lm-eval inserts its `run` subcommand when none is given
    try:
        cli_evaluate()
    except ModelArgsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
