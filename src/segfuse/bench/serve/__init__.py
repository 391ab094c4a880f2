"""`segfuse bench serve`: the server under concurrent users; first content per API, determinism, structured output."""
