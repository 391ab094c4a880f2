"""`segfuse bench speed`: a fused answer against its members, the floor, the reference method, N users at once."""
