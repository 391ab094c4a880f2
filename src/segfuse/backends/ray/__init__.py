"""Members whose copies run in Ray actors across a cluster (``ray:SPEC#replicas=K``; docs/deploy.md).

- ``settings.py``: the spec's own keys, and what each copy asks Ray for;
- ``host.py``: one copy, a Ray actor that loads the member and runs its calls for every caller;
- ``loop.py``: the copy's member thread: calls that arrive together run as one batch; idle sessions expire;
- ``member.py``: :class:`RayMember`, the copies as one member to the engine;
- ``session.py``: a session pinned to its copy, read again on another when that copy is lost;
- ``copies.py`` and ``affinity.py``: which copies are up, and which one a new session goes to.
"""
