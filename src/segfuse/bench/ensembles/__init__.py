"""`segfuse bench ensembles`: two ensembles that share members on one server, loaded on demand."""
