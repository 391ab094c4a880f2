"""A Ray member's spec, placement and prefix affinity (pure logic), and the error without a Ray cluster.

tests/test_ray.py runs Ray members on a real cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from segfuse.backends.ray.affinity import BLOCK, Affinity, prefix_keys
from segfuse.backends.ray.settings import (
    CPU_THREADS,
    GPU_THREADS,
    RaySettings,
    parse_target,
    placement,
)
from segfuse.backends.registry import MemberSpec
from segfuse.errors import InvalidRequestError
from segfuse.member_options import MemberOptions
from segfuse.types import Message


def test_the_spec_splits_the_ray_keys_from_the_inner_members():
    spec = MemberSpec.parse("ray:/m/qwen.gguf#qwen,replicas=2,threads=1,cpus=0.5,slots=4,expire-s=60")
    assert spec.backend == "ray"
    inner, settings = parse_target(spec.target)
    assert inner == "/m/qwen.gguf#qwen,threads=1,slots=4"
    assert (settings.replicas, settings.cpus, settings.expire_s, settings.gpus) == (2, 0.5, 60.0, None)
    assert parse_target("smollm2-135m") == ("smollm2-135m", RaySettings())
    assert parse_target("transformers:/m/x#device=cuda,replicas=3")[0] == "transformers:/m/x#device=cuda"


@pytest.mark.parametrize(
    "target, says",
    [
        ("", "names no member"),
        ("ray:smollm2-135m", "names no member"),
        ("smollm2-135m#replicas=0", "replicas must be at least 1"),
        ("smollm2-135m#replicas=two", "must be a number"),
        ("smollm2-135m#cpus=0", "cpus must be more than 0"),
        ("smollm2-135m#expire_s=-1", "expire_s"),
        ("smollm2-135m#restarts=-2", "restarts"),
    ],
)
def test_a_bad_spec_is_refused_saying_what_is_wrong(target, says):
    with pytest.raises(InvalidRequestError, match=says):
        parse_target(target)


def test_a_copy_asks_for_its_threads_as_cpus_and_a_gpu_when_it_offloads():
    default = placement(RaySettings(), None, "m")
    assert (default.cpus, default.gpus, default.threads, default.gpu_layers) == (CPU_THREADS, 0, CPU_THREADS, 0)
    given = placement(RaySettings(), MemberOptions(threads=3), "m")
    assert (given.cpus, given.threads) == (3, 3)
    spec = placement(RaySettings(), MemberOptions(threads=3), "m#threads=6")  # the spec's own go over the others
    assert (spec.cpus, spec.threads) == (6, 6)
    fraction = placement(RaySettings(cpus=0.25), MemberOptions(threads=1), "m")
    assert (fraction.cpus, fraction.threads) == (0.25, 1)
    gpu = placement(RaySettings(), None, "m#gpu_layers=-1")
    assert (gpu.gpus, gpu.threads, gpu.gpu_layers) == (1.0, GPU_THREADS, -1)
    asked = placement(RaySettings(gpus=0.5), None, "m")
    assert (asked.gpus, asked.gpu_layers) == (0.5, None)  # given a GPU: the member's own default (all layers)


def test_prefix_keys_are_shared_by_a_system_prompt_a_long_start_and_a_next_turn():
    system = Message("system", "You answer in French. " * 30)  # over two blocks
    one = prefix_keys([system, Message("user", "Hi")])
    other = prefix_keys([system, Message("user", "Bye")])
    shared = len(system.content) // BLOCK + 1  # its blocks and its end
    assert one[:shared] == other[:shared] and one[shared:] != other[shared:]
    text = "x" * (BLOCK + 10)
    assert prefix_keys([Message("raw", text + "a")])[0] == prefix_keys([Message("raw", text + "b")])[0]
    assert prefix_keys([Message("raw", text + "a")])[1] != prefix_keys([Message("raw", text + "b")])[1]
    turn = [Message("user", "Name a color."), Message("assistant", "Red.")]
    assert prefix_keys([*turn, Message("user", "Another?")])[: len(prefix_keys(turn))] == prefix_keys(turn)
    assert prefix_keys([Message("user", "a")]) != prefix_keys([Message("assistant", "a")])  # roles count


def test_affinity_finds_the_longest_known_prefix_and_forgets_the_oldest():
    affinity = Affinity(max_keys=4)
    short, long = prefix_keys([Message("user", "a")]), prefix_keys([Message("user", "a"), Message("user", "b")])
    affinity.remember(short, 0)
    affinity.remember(long[len(short) :], 1)  # read by another copy after the shared start
    assert affinity.find(long) == 1 and affinity.find(short) == 0 and affinity.find(prefix_keys([])) is None
    affinity.remember(prefix_keys([Message("user", "c"), Message("user", "d")]), 2)  # 4 keys more: 8 > 4
    assert len(affinity) == 4 and affinity.find(short) is None and affinity.find(long) is None


@pytest.mark.slow
def test_without_a_ray_cluster_the_member_is_refused_with_the_fix():
    env_free = subprocess.run(
        [sys.executable, "-m", "segfuse.cli", "generate", "-m", "ray:smollm2-135m", "-m", "smollm2-135m", "hi"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=_without("RAY_ADDRESS"),
    )
    assert env_free.returncode != 0
    assert (
        "need a Ray cluster" in env_free.stderr + env_free.stdout and "RAY_ADDRESS" in env_free.stderr + env_free.stdout
    )


def _without(name: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != name}
