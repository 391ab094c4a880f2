"""What several benchmarks share: servers on loopback, their clients, the machine a report records; vLLM's server."""
