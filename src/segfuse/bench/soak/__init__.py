"""`segfuse bench soak`: the server under a seeded mix of traffic for a long run: nothing lost, nothing leaking."""
