"""`segfuse serve --ray`: the server as a Ray Serve application (docs/deploy.md, On a cluster).

The same app as `segfuse serve` (``server/app.py``), in front-end replicas behind Serve's HTTP proxy,
over members whose copies are Ray actors (``backends/ray``):

- ``plan.py``: which members run as copies (and how many, where), which are loaded by each front end;
- ``keeper.py``: the deployment that starts the copies and the shared state, owns them, and says where
  each copy runs and what is degraded; they stop with it;
- ``state.py``: what every front-end replica shares (the Responses store, the Hedge weights, the metrics'
  figures), one Ray actor, and each replica's side of it; ``board.py`` adds up the replicas' metrics;
- ``front.py``: a front-end replica, the app over the keeper's copies;
- ``streams.py``: the proxy's middleware that ends a stream its replica left unfinished (it died);
- ``app.py``: the Serve application, and its builder for `serve run` / `serve deploy`;
- ``run.py``: the command: a local Ray instance or a cluster joined, Serve started, stopped on a signal.
"""
