"""Member options reach the member the same way from every entry point, and GPU offload's settings reach llama.cpp.

Each entry point loads a real smollm2-135m with a small window and reads back what llama.cpp was given: the
model parameters (read from the struct passed to llama.cpp), the threads, the context's size and the
prefix cache's bound. On this CPU-only build an explicit gpu_layers still reaches llama.cpp's model
parameters (which it then ignores: nothing to offload to), and the default resolves to 0.
"""

from __future__ import annotations

import llama_cpp as lc
import pytest
from typer.testing import CliRunner

from segfuse.backends.llama_cpp import LlamaCppMember
from segfuse.backends.llama_cpp import member as llama_backend
from segfuse.backends.llama_cpp.runtime import can_offload, gpu_layers_for, threads_for
from segfuse.ensemble import Ensemble
from segfuse.errors import InvalidRequestError

MODEL = "smollm2-135m"
# Small enough to load fast; n_ctx + cells is a multiple of 256, so llama.cpp keeps the window as asked.
ASKED = {"n_ctx": 512, "threads": 1, "gpu_layers": 3, "prefix_cache_cells": 256}
CPU_ONLY = pytest.mark.skipif(can_offload(), reason="this llama-cpp-python can offload: the default is every layer")


def loaded_with(member: LlamaCppMember) -> dict:
    """What the member was loaded with, read back from the member and from llama.cpp (while it is open)."""
    return {
        "n_gpu_layers": member.model_params["n_gpu_layers"],
        "threads": member.threads,
        "n_ctx": member.n_ctx,
        "cells": member.prefix_cache.bound,
        "context": member.context.n_cells,
        "slots": member.slots,
        "options": member.options,
    }


def assert_reached(
    loaded: dict | LlamaCppMember, n_ctx: int = 512, threads: int = 1, gpu_layers: int = 3, cells: int = 256
) -> None:
    got = loaded if isinstance(loaded, dict) else loaded_with(loaded)
    assert got["n_gpu_layers"] == gpu_layers
    assert got["threads"] == threads
    assert got["n_ctx"] == n_ctx
    assert got["cells"] == cells
    assert got["context"] == n_ctx * got["slots"] + cells  # the context llama.cpp made
    assert got["options"].gpu_layers == gpu_layers and got["options"].prefix_cache_cells == cells


@pytest.fixture()
def loaded(monkeypatch):
    """What each llama.cpp member loaded while the test runs was loaded with (the registry looks `load` up
    at each load)."""
    members: list[dict] = []
    real = llama_backend.load

    def recording(target, shared=None):
        member = real(target, shared)
        members.append(loaded_with(member))
        return member

    monkeypatch.setattr(llama_backend, "load", recording)
    return members


# --- each entry point -------------------------------------------------------------------------


@pytest.mark.models
def test_cli_flags_reach_the_member(loaded):
    from segfuse.cli import app

    flags = ["--n-ctx", "512", "--threads", "1", "--gpu-layers", "3", "--prefix-cache-cells", "256"]
    done = CliRunner().invoke(app, ["generate", "-m", MODEL, *flags, "--max-tokens", "2", "--json", "Hi"])
    assert done.exit_code == 0, done.output
    (member,) = loaded
    assert_reached(member)


@pytest.mark.models
def test_profile_members_table_reaches_the_member_under_the_flags(loaded, tmp_path):
    from segfuse.cli import app

    profile = tmp_path / "profile.toml"
    profile.write_text(
        "[fusion]\nmax_tokens = 2\n\n[members]\nn_ctx = 512\nthreads = 2\ngpu_layers = 3\nprefix_cache_cells = 256\n"
    )
    done = CliRunner().invoke(
        app, ["generate", "-m", MODEL, "--profile", str(profile), "--threads", "1", "--json", "Hi"]
    )
    assert done.exit_code == 0, done.output
    (member,) = loaded
    assert_reached(member)  # threads: the flag's 1 over the profile's 2


def test_profile_with_an_unknown_member_option_is_refused(tmp_path):
    from segfuse.profiles import load_profile_members

    profile = tmp_path / "profile.toml"
    profile.write_text("[fusion]\nmax_tokens = 2\n\n[members]\ngpu_layer = 3\n")
    with pytest.raises(InvalidRequestError, match="gpu_layer") as caught:
        load_profile_members(profile)
    assert "gpu_layers" in caught.value.hint


@pytest.mark.models
def test_server_config_members_section_reaches_the_member(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from segfuse.config import build_config
    from segfuse.server.app import create_app, load_ensemble

    toml = tmp_path / "segfuse.toml"
    toml.write_text(
        f'[server]\nmax_concurrent = 1\n\n[members]\nmodels = ["{MODEL}"]\nn_ctx = 512\nthreads = 1\n'
        "gpu_layers = 3\nprefix_cache_cells = 256\n"
    )
    config = build_config(toml)
    with load_ensemble(config) as ensemble:
        (member,) = ensemble.members
        assert_reached(member)
        with TestClient(create_app(config, ensemble), base_url="http://127.0.0.1") as client:
            health = client.get("/health").json()
        assert health["placement"] == {member.name: member.placement}
        if not can_offload():
            assert member.placement == "CPU"


def test_server_flags_go_over_the_members_section(tmp_path):
    from segfuse.config import ConfigError, build_config

    toml = tmp_path / "segfuse.toml"
    toml.write_text("[members]\ngpu_layers = 3\nthreads = 2\n")
    config = build_config(toml, threads=1, main_gpu=1, split="row")
    assert config.members.load_options().given() == {
        "n_ctx": 4096,
        "threads": 1,
        "gpu_layers": 3,
        "main_gpu": 1,
        "split": "row",
    }
    toml.write_text("[members]\ngpu_layer = 3\n")
    with pytest.raises(ConfigError, match=r"members\.gpu_layer"):
        build_config(toml)


@pytest.mark.models
def test_member_spec_options_reach_the_member():
    spec = f"{MODEL}#tiny,n_ctx=512,threads=1,gpu_layers=3,prefix_cache_cells=256"
    with Ensemble([spec], n_ctx=4096, threads=2) as ensemble:  # the spec's own go over the ensemble's
        (member,) = ensemble.members
        assert member.name == "tiny"
        assert_reached(member)


@pytest.mark.models
def test_llm_plugin_options_reach_the_member(tmp_path, monkeypatch):
    llm = pytest.importorskip("llm")
    from segfuse import llm_plugin

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    (tmp_path / "segfuse.toml").write_text("[members]\nthreads = 2\nprefix_cache_cells = 256\n")
    monkeypatch.setattr(llm_plugin, "_loaded", {})
    model = llm.get_model("segfuse")
    response = model.prompt("Hi", members=MODEL, max_tokens=2, n_ctx=512, threads=1, gpu_layers=3)
    response.text()
    (ensemble,) = llm_plugin._loaded.values()
    try:
        assert_reached(ensemble.members[0])  # prefix_cache_cells from segfuse.toml, threads from -o
    finally:
        ensemble.close()
    with pytest.raises(Exception, match="gpu_layer"):
        model.prompt("Hi", members=MODEL, gpu_layer=3).text()


@pytest.mark.models
def test_llm_plugin_reads_on_off_options_as_the_other_entry_points_do(tmp_path, monkeypatch):
    llm = pytest.importorskip("llm")
    from segfuse import llm_plugin

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    monkeypatch.setattr(llm_plugin, "_loaded", {})
    model = llm.get_model("segfuse")
    model.prompt("Hi", members=MODEL, max_tokens=1, threads=1, side_by_side="true").text()  # as `-o side_by_side true`
    (ensemble,) = llm_plugin._loaded.values()
    try:
        assert ensemble.members[0].capabilities.parallel_safe
    finally:
        ensemble.close()
    with pytest.raises(Exception, match="side_by_side"):
        model.prompt("Hi", members=MODEL, side_by_side="sometimes").text()


@pytest.mark.models
def test_lm_eval_model_args_reach_the_member():
    pytest.importorskip("lm_eval")
    from segfuse.eval.lm_eval_adapter import ModelArgsError, SegfuseLM

    args = f"models={MODEL},system=member:{MODEL},max_tokens=2,n_ctx=512,threads=1,gpu_layers=3,prefix_cache_cells=256"
    lm = SegfuseLM.create_from_arg_string(args)
    try:
        assert_reached(lm.ensemble.members[0])
    finally:
        lm.ensemble.close()
    with pytest.raises(ModelArgsError, match=r"gpu_layer.*it takes.*gpu_layers"):
        SegfuseLM.create_from_arg_string(f"models={MODEL},gpu_layer=3")


# --- refusals -----------------------------------------------------------------------------------


def test_an_unknown_spec_key_names_the_member_and_the_allowed_keys():
    with pytest.raises(InvalidRequestError, match=f"gpu_layer.*{MODEL}#gpu_layer=3") as caught:
        Ensemble([f"{MODEL}#gpu_layer=3"])
    assert "gpu_layers" in caught.value.hint and "n_ctx" in caught.value.hint


def test_a_bad_spec_value_names_the_member():
    with pytest.raises(InvalidRequestError, match=f"member '{MODEL}#split=diagonal'.*split"):
        Ensemble([f"{MODEL}#split=diagonal"])


def test_an_unknown_ensemble_option_is_refused_before_any_load(loaded):
    with pytest.raises(InvalidRequestError, match="unknown option 'gpu_layer'") as caught:
        Ensemble([MODEL], gpu_layer=3)
    assert "gpu_layers" in caught.value.hint
    assert loaded == []


# --- GPU offload ----------------------------------------------------------------------------------


@CPU_ONLY
@pytest.mark.models
def test_the_default_resolves_to_no_layers_on_a_cpu_only_build():
    assert gpu_layers_for(None) == 0
    with Ensemble([MODEL], n_ctx=512, threads=1, prefix_cache_cells=0) as ensemble:
        (member,) = ensemble.members
        assert member.model_params["n_gpu_layers"] == 0
        assert member.gpu_layers == 0 and member.placement == "CPU"


@pytest.mark.models
def test_explicit_offload_settings_reach_llama_cpps_model_parameters():
    spec = f"{MODEL}#gpu_layers=7,main_gpu=0,split=none"
    with Ensemble([spec], n_ctx=512, threads=1, prefix_cache_cells=0) as ensemble:
        (member,) = ensemble.members
        params = member.model_params
        assert (params["n_gpu_layers"], params["main_gpu"], params["split_mode"]) == (7, 0, lc.LLAMA_SPLIT_MODE_NONE)
        if not can_offload():  # llama.cpp takes the number, and has nowhere to put the layers
            assert member.gpu_layers == 0 and member.placement == "CPU"


@pytest.mark.models
def test_tensor_split_shares_reach_llama_cpp():
    with Ensemble([f"{MODEL}#tensor_split=3/1"], n_ctx=512, threads=1, prefix_cache_cells=0) as ensemble:
        assert ensemble.members[0].model_params["tensor_split"] == [3.0, 1.0]


def test_threads_follow_what_stays_on_the_cpu(monkeypatch):
    monkeypatch.setenv("SEGFUSE_THREADS", "6")
    assert threads_for(None, on_cpu_layers=31) == 6  # layers on the CPU set the pace: every core
    assert threads_for(None, on_cpu_layers=0) == 2  # wholly on a GPU: the CPU only samples
    assert threads_for(3, on_cpu_layers=0) == 3  # asked for: as asked


def test_side_by_side_reads_on_off_and_auto_follows_the_layers_on_a_gpu():
    from segfuse.backends.llama_cpp.runtime import side_by_side_for
    from segfuse.member_options import MemberOptions

    read = {v: MemberOptions.build({"side_by_side": v}).side_by_side for v in (True, False, "yes", "0", "auto")}
    assert read == {True: "on", False: "off", "yes": "on", "0": "off", "auto": "auto"}
    with pytest.raises(InvalidRequestError, match="side_by_side"):
        MemberOptions.build({"side_by_side": "sometimes"})
    assert side_by_side_for(None, 25, 25) and side_by_side_for("auto", 25, 25)  # wholly on a GPU
    assert not side_by_side_for(None, 24, 25) and not side_by_side_for(None, 0, 25)  # some layers on the CPU
    assert side_by_side_for("on", 0, 25) and not side_by_side_for("off", 25, 25)
