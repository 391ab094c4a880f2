"""`segfuse bench ray`: `segfuse serve --ray` beside `segfuse serve`; one call to a Ray member against a local one."""
