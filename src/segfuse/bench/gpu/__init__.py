"""`segfuse bench gpu`, `make gpu-pack`: the speed table on one GPU at real model sizes with random weights."""
