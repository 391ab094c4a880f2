"""`segfuse bench followers`: what the members the leader-alone default never asks would cost."""
