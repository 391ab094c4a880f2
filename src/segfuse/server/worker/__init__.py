"""The worker: the thread that runs every generation, and what it serves: a room of the server that is no API.

- ``jobs.py``: a request's job and the items it hands its handler (the worker's faults among them);
- ``job_queue.py``: the bounded queue of jobs waiting and in flight, and the counters;
- ``thread.py``: the ``Worker``, the thread that admits jobs and drives the scheduler;
- ``watchdog.py``: the thread that notices a stuck step;
- ``periodic.py``: the chores the worker runs between two steps (writing the prefix caches).
"""
