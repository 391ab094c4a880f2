"""Benchmarks that print ratios measured side by side in one run (never a gate on wall time).

- ``local``: one fused answer against the members alone, the method's floor, the
  paper's reference method and a response-level ensemble, and N users at once
  (``segfuse bench``; its parts: ``systems``, ``plan``, ``speeds``, ``users``,
  ``rss``, ``table``);
- ``gpu_pack``, ``gpu_bootstrap``, ``gpu_check``, ``gpu_models``, ``diagnose``: that
  benchmark on one GPU at real model sizes with random weights, from a pack;
- ``serving``: the real server under concurrent users, serial against
  concurrent worker (``segfuse bench serve``);
- ``load``: the client side of serving runs: streamed requests with the real
  ``openai`` client, their outcomes and summaries;
- ``processes``: starting and stopping servers on loopback (``segfuse serve``,
  ``llama_cpp.server``); the tests use them too;
- ``machine``: what a report records about the machine and the code.
"""
