"""The models a server serves and their members, loaded on demand: a room of the server that is no API.

- ``catalog.py``: the models by name (each ensemble, and every member alone), their members and defaults;
- ``pool.py``: the members, loaded when a request needs them within the memory budget, freed when idle;
- ``view.py``: what ``/v1/models`` and ``/health`` say of them.
"""
