"""The pure logic of `segfuse bench ray` (the benchmark itself runs Ray and two servers for minutes:
docs/performance.md): the blocks' order, the ratios and targets, the roles of Ray's processes."""

from __future__ import annotations

import pytest

from segfuse.bench.ray.process_cpu import COMMAND, role, spent
from segfuse.bench.ray.serving import NODE_IP, block_order, compare, configs


def test_blocks_take_turns_so_that_a_drift_falls_on_both_modes():
    assert block_order(2) == ["single", "ray", "ray", "single"]
    assert block_order(3) == ["single", "ray", "ray", "single", "single", "ray"]


def test_the_single_process_server_is_as_wide_as_the_ray_replicas_together():
    found = configs(
        max_concurrent=4, replicas=2, queue_size=8, models=["a.gguf"], threads=1, n_ctx=None, cache_dir=None
    )
    assert found["single"]["server"]["max_concurrent"] == 8
    assert found["ray"]["server"]["max_concurrent"] == 4
    assert found["ray"]["ray"] == {"replicas": 2, "node_ip": NODE_IP}
    assert NODE_IP != "127.0.0.1"  # Ray rewrites 127.0.0.1 as the machine's network address
    assert "ray" not in found["single"]


def level(latency: float, first: float | None, tps: float) -> dict:
    return {"latency_p50_s": latency, "latency_p95_s": 2 * latency, "ttfs_p50_s": first, "output_tokens_per_s": tps}


def test_ratios_are_ray_over_single_and_each_target_says_whether_it_was_met():
    modes = {"single": {"1": level(1.0, 0.5, 10.0)}, "ray": {"1": level(1.2, 0.55, 9.0)}}
    ratios, targets = compare(modes)
    assert ratios["1"]["p50_latency"] == pytest.approx(1.2)
    assert ratios["1"]["throughput"] == pytest.approx(0.9)
    assert targets["latency_1"]["met"] is False  # 1.2 > 1.15
    assert targets["first_content_1"]["met"] is True  # 1.1 <= 1.2
    no_text = {"single": {"1": level(1.0, None, 10.0)}, "ray": {"1": level(1.0, 0.5, 10.0)}}
    assert compare(no_text)[1]["first_content_1"]["met"] is None  # not measured: neither met nor missed


def test_each_process_of_the_tree_has_its_role():
    assert role("anything", is_root=True) == COMMAND
    assert role("ray::MemberHost.loop", is_root=False) == "member copies"
    assert role("ray::ServeReplica:segfuse:Front", is_root=False) == "front-end replicas"
    assert role("ray::ProxyActor", is_root=False) == "Serve: proxy"
    assert role("/venv/lib/ray/core/src/ray/gcs/gcs_server --flags", is_root=False) == "Ray: GCS"
    assert spent({"a": 1.0, "b": 2.0}, {"a": 1.5, "b": 2.0, "c": 0.25}) == {"a": 0.5, "c": 0.25}
