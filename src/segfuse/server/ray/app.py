"""The Serve application: the keeper of the members' copies and the front-end replicas before it.

:func:`application` makes it from a server configuration (`segfuse serve --ray` runs it);
:func:`build` is the same as a Serve application builder, for `serve run` / `serve deploy` and KubeRay's
RayService, taking `segfuse serve`'s settings as the application's ``args``::

    applications:
      - name: segfuse
        route_prefix: /
        import_path: segfuse.server.ray.app:build
        args: {config: /etc/segfuse/segfuse.toml, replicas: 2}

The keeper (``Members``) runs on the head node and asks for no CPU (it waits on its copies), as does the
shared state it starts; each front-end replica (``Front``) asks for ``[ray] frontend_cpus`` and takes up
to ``[limits] limit_concurrency`` requests at once from the proxy (the server's own queue and 429s decide
the rest).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from ...config import ConfigError, RaySection, ServerConfig, build_config
from .front import Front
from .keeper import FRONT, KEEPER, Keeper
from .state import HEAD

GRACE_S = 5.0  # how long a stopping replica's streams may go on before they end (with an error event)


def application(config: ServerConfig) -> Application:
    """The application for `config` (its ``[ray]`` table sizes it)."""
    data = config.model_dump(mode="json")
    logs = {"log_level": config.server.log_level.upper()}
    keeper = serve.deployment(
        name=KEEPER,
        num_replicas=1,
        max_ongoing_requests=64,
        max_constructor_retry_count=1,
        logging_config=logs,
        ray_actor_options={"num_cpus": 0, "resources": {HEAD: 0.001}},
    )(Keeper)
    front = serve.deployment(
        name=FRONT,
        num_replicas=config.ray.replicas,
        max_ongoing_requests=config.limits.limit_concurrency,
        graceful_shutdown_timeout_s=GRACE_S,
        logging_config=logs,
        ray_actor_options={"num_cpus": config.ray.frontend_cpus},
    )(Front)
    return front.bind(data, keeper.bind(data))


def build(args: dict[str, Any]) -> Application:
    """Serve's application builder: `args` are ``config`` (a TOML file's path) and any setting `segfuse
    serve` takes by its flat name (``host``, ``models``, ``threads``, ``replicas``, ... : config.build_config)."""
    given = dict(args)
    path = given.pop("config", None)
    defaults = given.pop("defaults", None)
    try:
        config = build_config(path, defaults=defaults, **given)
    except ValueError as exc:
        raise ConfigError(
            f"application args: {exc}",
            "give config (a TOML path) and segfuse serve's settings by their names (docs/deploy.md, On a cluster)",
        ) from None
    return application(config.model_copy(update={"ray": RaySection(**{**config.ray.model_dump(), "enabled": True})}))


__all__ = ["application", "build"]
