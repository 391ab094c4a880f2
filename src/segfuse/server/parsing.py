"""Request bodies -> validated requests, for every API: strict parsing within ``[limits]``, and fusion options.

Each API names what its body may hold (an ``Endpoint``: its request type, its neutral values, its limits
check). A request field segfuse does not implement is refused (400 ``unsupported_parameter``) unless it is
tolerated (``wire.TOLERATED_PARAMETERS``) or neutral (the API's table); everything here raises
``serving.APIError``. What a chat request means for the worker is planned in ``chat.planning``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from ..config import LimitsSection
from ..errors import InvalidRequestError
from ..options import FusionOptions
from . import limits as checks
from .serving import APIError
from .wire import TOLERATED_PARAMETERS

log = logging.getLogger("segfuse.server")


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (``false`` is not ``0``)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return isinstance(value, bool) and isinstance(neutral, bool) and value == neutral
    if isinstance(neutral, int | float):
        return isinstance(value, int | float) and value == neutral
    if isinstance(neutral, dict):
        return (
            isinstance(value, dict)
            and value.keys() == neutral.keys()
            and all(_same(value[k], neutral[k]) for k in neutral)
        )
    if isinstance(neutral, list):
        return isinstance(value, list) and len(value) == len(neutral) and all(map(_same, value, neutral))
    return type(value) is type(neutral) and value == neutral


@dataclass(frozen=True)
class Endpoint:
    """What one endpoint's body may hold: its request type, which other OpenAI fields pass, and the
    ``[limits]`` check of a validated request."""

    request: type[BaseModel]
    supported: tuple[str, ...]
    neutral: dict[str, tuple[Any, ...]]
    check: Callable[[Any, LimitsSection], None] | None = None


DEFAULT_LIMITS = LimitsSection()


def unsupported(data: dict[str, Any], endpoint: Endpoint) -> list[str]:
    """The request fields segfuse would have to ignore to answer, in body order.

    Supported fields, tolerated ones and OpenAI parameters at a neutral value
    (null included) pass; anything else would change what the client asked for.
    """
    refused = []
    for name, value in data.items():
        if name in endpoint.supported or name in TOLERATED_PARAMETERS:
            continue
        neutral = endpoint.neutral.get(name)
        if neutral is not None and (value is None or any(_same(value, n) for n in neutral)):
            continue
        refused.append(name)
    return refused


def unsupported_error(names: list[str], endpoint: Endpoint) -> APIError:
    """400 unsupported_parameter naming the first refused field (and the others in the message)."""
    first = names[0]
    if first in endpoint.neutral:
        neutral = " or ".join([json.dumps(v) for v in endpoint.neutral[first]] + ["null"])
        why = f"unsupported parameter {first!r}: segfuse does not implement it (accepted only as {neutral})"
    elif first in FusionOptions.model_fields:
        why = (
            f"unsupported parameter {first!r}: fusion options go in the 'segfuse' object, "
            f'as {{"segfuse": {{"{first}": ...}}}}'
        )
    else:
        why = f"unsupported parameter {first!r}: segfuse does not know it"
    also = f" (also unsupported: {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
    supported = ", ".join(endpoint.supported)
    return APIError(
        400,
        f"{why}{also}. Supported parameters: {supported} (see docs/server.md)",
        code="unsupported_parameter",
        param=first,
    )


def parse_request(body: bytes, endpoint: Endpoint, limits: LimitsSection = DEFAULT_LIMITS) -> Any:
    """JSON bytes -> a validated request of `endpoint`'s type within ``limits``.

    400 for bad JSON, a parameter segfuse does not implement (``unsupported``) or a limit passed
    (``limit_exceeded``), 422 for a bad shape.
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # thousands of nested brackets: refused like any body nested too deeply
        raise checks.exceeded(
            "body", "objects and arrays nest too deeply", limits.max_json_depth, "max_json_depth"
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    checks.check_body_depth(data, limits)
    _refuse_lone_surrogates(data)
    refused = unsupported(data, endpoint)
    if refused:
        raise unsupported_error(refused, endpoint)
    try:
        request = endpoint.request.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise APIError(422, f"{where}: {first['msg']}{more}", code="invalid_value", param=where or None) from None
    if endpoint.check is not None:
        endpoint.check(request, limits)
    if request.model_extra:
        log.debug("ignoring fields that do not change the answer: %s", ", ".join(sorted(request.model_extra)))
    return request


def _refuse_lone_surrogates(data: Any, where: str = "") -> None:
    """400 naming the field of a string that holds half of a UTF-16 pair (JSON's "\\ud800"): no
    tokenizer can encode it. The body's depth is bounded before this walk."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(
                400,
                f"{where or 'body'}: the text holds a lone UTF-16 surrogate, which is not a "
                "character; send valid Unicode",
                code="invalid_value",
                param=where or None,
            ) from None
    elif isinstance(data, dict):
        for key, value in data.items():
            _refuse_lone_surrogates(key, where)
            _refuse_lone_surrogates(value, f"{where}.{key}" if where else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _refuse_lone_surrogates(value, f"{where}.{i}" if where else str(i))


@dataclass(frozen=True)
class Defaults:
    """The fusion options of requests that do not set them: each model's (an ensemble's own, over the
    server's), by the name a request gives (none: the server's default model)."""

    models: Mapping[str, FusionOptions]
    default: str

    def of(self, model: str | None) -> FusionOptions:
        chosen = self.models.get(model or self.default)
        return chosen if chosen is not None else self.models[self.default]


def fusion_options(request: Any, defaults: FusionOptions | Defaults) -> FusionOptions:
    """The defaults of the model the request names, with whatever the request sets on top."""
    base = defaults.of(request.model) if isinstance(defaults, Defaults) else defaults
    values: dict[str, Any] = base.model_dump()
    asked = {
        "max_tokens": request.answer_budget,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "stop": request.stop,
    }
    values.update({k: v for k, v in asked.items() if v is not None})
    if "hedge_persist" in (request.segfuse or {}):  # it would change every later request, not this one
        raise APIError(
            400,
            "hedge_persist is the server's setting ([server] hedge_persist), not a request's",
            code="unsupported_parameter",
            param="segfuse.hedge_persist",
        )
    values.update(request.segfuse or {})  # an explicit null is a value here (gate or accept_margin: none)
    try:
        return FusionOptions.build(**values)
    except InvalidRequestError as exc:
        raise APIError(400, exc.message, code="invalid_value", param=_option_param(request, exc.field)) from None


def _option_param(request: Any, field: str | None) -> str | None:
    """Where the client wrote a refused fusion option: top level (seed, stop, ...) or in ``segfuse``."""
    if field is None:
        return None
    name = field.split(".")[0]
    if name in (request.segfuse or {}):
        return f"segfuse.{field}"
    return name


__all__ = [
    "DEFAULT_LIMITS",
    "Defaults",
    "Endpoint",
    "fusion_options",
    "parse_request",
    "unsupported",
    "unsupported_error",
]
