"""`segfuse serve --ray`: the server as a Ray Serve application, until SIGINT or SIGTERM.

Without ``[ray] address`` it starts a local Ray instance whose node is on :data:`LOCAL_NODE_IP`
(a loopback address: Ray rewrites 127.0.0.1 and localhost as a node address into the machine's
network address), and stops it when it ends. With one it joins that cluster and, when it ends,
removes its own application (and Serve's controller and proxies, where it started Serve and no other
application runs there); everything else on the cluster stays as it was.

Serve's proxy listens on ``[server] host`` and ``port`` (on the head node). The proxies this command
starts get :data:`PROXY_ENV`; a Serve that was running already keeps the proxies it has.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ...config import ConfigError, ServerConfig
from ...errors import SegfuseError
from ..app import configure_logging
from .plan import cpus_asked, plan
from .streams import CALLBACK, ENV

log = logging.getLogger("segfuse.server")
LOCAL_NODE_IP = "127.0.0.2"
NOT_NODE_ADDRESSES = ("127.0.0.1", "localhost", "::1")
# The environment of the proxies this command starts: the middleware that ends broken streams, and
# requests spread over every front-end replica (by default a proxy prefers the replicas on its own node,
# which leaves the others idle behind the one proxy on the head)
PROXY_ENV = {ENV: CALLBACK, "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}


def run_on_ray(config: ServerConfig) -> None:
    """Serve `config` on Ray until interrupted (module docstring); exit 1 when the application cannot start."""
    configure_logging(config)
    check(config)
    with cluster(config) as local:
        import ray
        from ray import serve

        name = config.ray.app_name
        signal.signal(signal.SIGTERM, _interrupt)  # after ray.init, which sets its own
        ours = False
        try:
            ours = start_serve(config, local)
            deploy(config)
            s = config.server
            log.info(
                "serving on Ray (%s): open http://%s:%d/ for the web view; API at /v1%s",
                ray.get_runtime_context().gcs_address,
                s.host,
                s.port,
                " (API key required)" if s.api_key else "",
            )
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            log.info("stopping")
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):  # the teardown is bounded; let it finish
                signal.signal(sig, signal.SIG_IGN)
            stop_serve(serve, name, ours or local)


def check(config: ServerConfig) -> None:
    """Refuse what cannot work before starting anything."""
    if config.server.port == 0:
        raise ConfigError("serve --ray needs a port (Serve's proxy cannot pick one and say which)", "give --port")
    ip = config.ray.node_ip
    if ip is not None and ip.lower() in NOT_NODE_ADDRESSES:
        raise ConfigError(
            f"[ray] node_ip {ip} cannot be a Ray node's address (Ray rewrites it into the machine's network address)",
            f"use another loopback address, e.g. {LOCAL_NODE_IP}",
        )
    plan(config)  # the members' Ray keys


@contextmanager
def cluster(config: ServerConfig) -> Iterator[bool]:
    """Ray joined (at ``[ray] address``) or started here; True for a local instance (stopped on leaving)."""
    import ray

    r = config.ray
    local = r.address is None
    options: dict[str, Any] = {"address": r.address or "local", "logging_level": "warning"}
    if local:
        asked, most = cpus_asked(config)
        cpus = r.local_cpus or max(os.cpu_count() or 1, math.ceil(asked))
        if most > cpus:
            raise ConfigError(
                f"a copy asks for {most:g} CPUs and the local Ray instance has {cpus}",
                "lower the members' threads= or cpus=, or raise [ray] local_cpus",
            )
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # else Ray reports its usage over the internet
        os.environ.update(PROXY_ENV)  # what this instance's processes start with
        options.update(num_cpus=cpus, include_dashboard=False, _node_ip_address=r.node_ip or LOCAL_NODE_IP)
    elif r.node_ip is not None:
        options["_node_ip_address"] = r.node_ip
    ray.init(**options)
    try:
        yield local
    finally:
        ray.shutdown()  # a local instance stops with it; a joined cluster is only left


def start_serve(config: ServerConfig, local: bool) -> bool:
    """Start Serve unless it runs already (then its proxies stay as they are); True where this started it."""
    from ray import serve

    running = serve.status()
    if config.ray.app_name in running.applications:
        raise ConfigError(
            f"a Serve application named {config.ray.app_name!r} runs on this cluster already",
            "stop it, or name this one otherwise with [ray] app_name",
        )
    if running.proxies:
        log.warning(
            "Serve runs on this cluster already: its proxies stay as they are (a stream whose replica "
            "dies ends without an error event unless they were started with %s=%s)",
            ENV,
            CALLBACK,
        )
        return False
    s, limits = config.server, config.limits
    http = {
        "host": s.host,
        "port": s.port,
        "keep_alive_timeout_s": limits.timeout_keep_alive_s,
        "request_timeout_s": config.ray.proxy_timeout_s,
    }
    try:
        serve.start(
            http_options=http,
            proxy_location=config.ray.proxy_location,
            logging_config={"log_level": config.server.log_level.upper()},
            controller_options={"runtime_env": {"env_vars": PROXY_ENV}},
        )
    except Exception as exc:  # Serve's proxy failed to start: the port is the usual reason
        if "Failed to bind" not in str(exc):
            raise
        log.error("Serve's proxy could not listen on %s:%d (in use?): give another --port", s.host, s.port)
        raise SystemExit(3) from None  # as `segfuse serve` where uvicorn cannot bind
    return True


def deploy(config: ServerConfig) -> None:
    """Run the application and wait until every replica is up (the members loaded)."""
    from ray import serve

    from .app import application

    log.info("starting the members' copies and %d front-end replica(s)…", config.ray.replicas)
    try:
        serve.run(application(config), name=config.ray.app_name, route_prefix="/", blocking=False)
    except RuntimeError as exc:  # Serve's deploy failure: the replica's own error ends its deployment's message
        raise SegfuseError(
            f"the application could not start: {_why(config.ray.app_name) or _last_line(str(exc))}",
            "see the replicas' logs (Ray's session logs, serve/)",
        ) from None


def stop_serve(serve: Any, name: str, shutdown: bool) -> None:
    """Remove the application (its copies stop with its keeper); shut Serve down where `shutdown` and no
    other application runs."""
    try:
        serve.delete(name)
        if shutdown and not serve.status().applications:
            serve.shutdown()
    except Exception:  # leaving anyway: a local instance is stopped whole next
        log.exception("stopping Serve failed")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _why(name: str) -> str | None:
    """The last line of the first failed deployment's message (its replica's exception)."""
    from ray import serve

    try:
        app = serve.status().applications.get(name)
    except Exception:
        return None
    failed = [d.message for d in (app.deployments.values() if app else []) if d.message and "Traceback" in d.message]
    return _last_line(failed[0]) if failed else None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown"


__all__ = ["LOCAL_NODE_IP", "check", "run_on_ray"]
