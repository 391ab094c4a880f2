"""Benchmarks that print ratios measured side by side in one run (never a gate on wall time): a room per
subcommand of `segfuse bench`, and what several of them share in one place.

- ``speed``: one fused answer against the members alone, the method's floor, the paper's reference method
  and a response-level ensemble, and N users at once (``segfuse bench speed``, plain ``segfuse bench``);
- ``serve``: the real server under concurrent users, serial against concurrent worker (``segfuse bench
  serve``), and the server's other measures: first content per API, determinism, structured output;
- ``chat``: chats and long shared prompts with and without the prefix cache (``segfuse bench chat``), and
  that cache's answers and restarts;
- ``followers``: what the members the default never asks would cost (``segfuse bench followers``);
- ``soak``: the server under a seeded mix of traffic for a long run (``segfuse bench soak``);
- ``ray``: ``segfuse serve --ray`` beside ``segfuse serve`` (``segfuse bench ray``);
- ``gpu``: the speed table on one GPU at real model sizes with random weights, from a pack (``segfuse bench
  gpu``, ``make gpu-pack``);
- ``ensembles``: two ensembles that share members, loaded on demand (``segfuse bench ensembles``);
- ``common``: starting and stopping servers on loopback (the tests use them too), the serving runs' client,
  what a report records about the machine and the code, and the vLLM server of ``make test-vllm``.
"""
