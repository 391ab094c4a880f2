"""Models people already have: Ollama's store, the Hugging Face cache, LM Studio, llama.cpp's cache.

Each test builds the tools' real on-disk layouts in a temporary home (model files linked to the
embedded GGUF files, never copied), points the tools' environment variables there, and names the
models the way each tool does. Nothing here mocks the resolver.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from segfuse import models as catalogue
from segfuse.backends.remote.prompt_source import load_prompt_source
from segfuse.errors import ModelFileError, SegfuseError, UnknownModelError
from segfuse.listing import list_models
from segfuse.models import check_gguf, resolve

SMOL_SPEC, GEMMA_SPEC = catalogue.CATALOGUE["smollm2-135m"], catalogue.CATALOGUE["gemma3-270m"]
SMOL = catalogue.model_path(SMOL_SPEC)  # ~100 MB, chat template (Q4_1, llama)
GEMMA = catalogue.model_path(GEMMA_SPEC)  # base model: no chat template (Q4_K_M, gemma3)
SHA256 = {SMOL: SMOL_SPEC.sha256, GEMMA: GEMMA_SPEC.sha256}
REV = "2b4c6d8e0a1b3c5d7e9f0a2b4c6d8e0a1b3c5d7e"  # a snapshot's commit hash
SEGFUSE = [sys.executable, "-m", "segfuse.cli"]
TOOL_VARS = ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "LLAMA_CACHE", "XDG_CACHE_HOME")
OLLAMA_TEMPLATE = b"{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"  # Go, unused


@pytest.fixture(autouse=True)
def _embedded_files():
    if not (SMOL.is_file() and catalogue.is_ready(GEMMA_SPEC)):
        pytest.fail("embedded models not prepared; run `make models`", pytrace=False)


# --- the tools' layouts ---------------------------------------------------------------------------


def _link(target: Path, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_symlink():
        os.symlink(target, path)
    return path


def ollama_layer(store: Path, media_type: str, content: Path | bytes) -> dict:
    """A layer and its blob, named by digest as `ollama pull` stores it (the model's blob is linked)."""
    if isinstance(content, Path):
        digest, size = SHA256[content], content.stat().st_size
        _link(content, store / "blobs" / f"sha256-{digest}")
    else:
        digest, size = hashlib.sha256(content).hexdigest(), len(content)
        (store / "blobs").mkdir(parents=True, exist_ok=True)
        (store / "blobs" / f"sha256-{digest}").write_bytes(content)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": size}


def ollama_model(store: Path, where: str, model: Path | None = SMOL, extra: tuple[dict, ...] = ()) -> Path:
    """manifests/HOST/NAMESPACE/MODEL/TAG: a model layer (the GGUF), Ollama's template, params and license."""
    config = ollama_layer(
        store,
        "application/vnd.docker.container.image.v1+json",
        b'{"model_format":"gguf","model_family":"llama","file_type":"Q4_1"}',
    )
    layers = [ollama_layer(store, "application/vnd.ollama.image.model", model)] if model else []
    layers += [
        ollama_layer(store, "application/vnd.ollama.image.template", OLLAMA_TEMPLATE),
        ollama_layer(store, "application/vnd.ollama.image.params", b'{"stop":["<|im_end|>"]}'),
        ollama_layer(store, "application/vnd.ollama.image.license", b"Apache License 2.0"),
        *extra,
    ]
    manifest = store / "manifests" / where
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": config,
                "layers": layers,
            }
        )
    )
    return manifest


def hf_repo(hub: Path, repo_id: str, files: dict[str, Path | bytes], rev: str = REV) -> Path:
    """models--ORG--NAME/{blobs,refs/main,snapshots/REV/...}, snapshot files linking to blobs as the hub does."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    for relpath, content in files.items():
        if isinstance(content, Path):  # blobs are named by the file's sha256 (a stand-in for big unknown files)
            digest = SHA256.get(content) or hashlib.sha256(str(content).encode()).hexdigest()
            blob = _link(content, repo / "blobs" / digest)
        else:
            blob = repo / "blobs" / hashlib.sha1(content).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(content)
        snapshot_file = repo / "snapshots" / rev / relpath
        _link(Path(os.path.relpath(blob, snapshot_file.parent)), snapshot_file)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return repo / "snapshots" / rev


def lmstudio_model(models: Path, repo_id: str, files: dict[str, Path | bytes]) -> Path:
    for name, content in files.items():
        if isinstance(content, Path):
            _link(content, models / repo_id / name)
        else:
            (models / repo_id).mkdir(parents=True, exist_ok=True)
            (models / repo_id / name).write_bytes(content)
    return models / repo_id


def llama_cache_model(cache: Path, repo_id: str, tag: str, rfilename: str, model: Path) -> Path:
    """llama.cpp's flat cache (before 2026): manifest=ORG=REPO=TAG.json and the file as ORG_REPO_FILE."""
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"manifest={repo_id.replace('/', '=')}={tag}.json").write_text(
        json.dumps({"ggufFile": {"rfilename": rfilename, "size": model.stat().st_size}})
    )
    return _link(model, cache / f"{repo_id}_{rfilename}".replace("/", "_"))


CHECKPOINT = {
    "config.json": b'{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16"}',
    "tokenizer_config.json": b'{"chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", '
    b'"eos_token": "<|im_end|>"}',
}


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A home where the user pulled models with every tool, at each tool's default place."""
    monkeypatch.setenv("SEGFUSE_CACHE_DIR", str(catalogue.cache_dir()))  # the embedded models stay found
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in TOOL_VARS:
        monkeypatch.delenv(var, raising=False)
    ollama = tmp_path / ".ollama" / "models"
    ollama_model(ollama, "registry.ollama.ai/library/smollm2/135m")
    ollama_model(ollama, "registry.ollama.ai/someone/smol/latest")
    ollama_model(
        ollama,
        "registry.ollama.ai/library/llava/7b",
        extra=(ollama_layer(ollama, "application/vnd.ollama.image.projector", b"GGUF projector"),),
    )
    ollama_model(
        ollama,
        "registry.ollama.ai/library/imported/latest",
        model=None,
        extra=(ollama_layer(ollama, "application/vnd.ollama.image.tensor; name=w; dtype=BF16", b"w"),),
    )
    hub = tmp_path / ".cache" / "huggingface" / "hub"
    hf_repo(hub, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", {"smollm2-135m-instruct-q4_1.gguf": SMOL})
    hf_repo(
        hub,
        "bartowski/SmolLM2-135M-Instruct-GGUF",
        {f"SmolLM2-135M-Instruct-{q}.gguf": SMOL for q in ("Q8_0", "Q4_K_M", "Q5_K_S")}
        | {"mmproj-SmolLM2-135M-Instruct-f16.gguf": SMOL, "README.md": b"# SmolLM2 GGUF\n"},
    )
    hf_repo(hub, "unsloth/gemma-3-270m-GGUF", {"gemma-3-270m-Q8_0.gguf": GEMMA, "gemma-3-270m-Q6_K.gguf": GEMMA})
    hf_repo(hub, "Qwen/tiny-chat", CHECKPOINT)
    lmstudio = tmp_path / ".lmstudio" / "models"
    lmstudio_model(lmstudio, "lmstudio-community/gemma-3-270m-GGUF", {"gemma-3-270m-Q4_K_M.gguf": GEMMA})
    lmstudio_model(lmstudio, "lmstudio-community/SmolLM2-135M-Instruct-GGUF", {"SmolLM2-135M-Instruct-Q4_1.gguf": SMOL})
    lmstudio_model(
        lmstudio, "mlx-community/SmolLM2-135M-Instruct-4bit", {"model.safetensors": b"{}", "config.json": b"{}"}
    )
    llama_cache = tmp_path / ".cache" / "llama.cpp"
    llama_cache_model(
        llama_cache, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "latest", "smollm2-135m-instruct-q4_1.gguf", SMOL
    )
    _link(GEMMA, llama_cache / "gemma-3-270m-it-qat-Q4_0.gguf")  # a `llama-cli -mu URL` download
    return tmp_path


def segfuse(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SEGFUSE, *args], capture_output=True, text=True, timeout=600, env=os.environ.copy())


def error_of(name: str, **kwargs) -> SegfuseError:
    with pytest.raises(SegfuseError) as caught:
        resolve(name, **kwargs)
    return caught.value


def ready_gguf(path: Path, quantisation: str, architecture: str, *, chat_template: bool) -> dict[str, object]:
    """The facts `segfuse models --json` lists for a ready GGUF file: its size and what its metadata says."""
    return {
        "size": path.stat().st_size,
        "quantisation": quantisation,
        "architecture": architecture,
        "chat_template": chat_template,
        "status": "ready",
    }


# --- `segfuse models` ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_model_list_shows_every_source_with_what_the_files_say(home):
    done = segfuse("models", "--json")
    assert done.returncode == 0, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    embedded = [n for n, r in rows.items() if r["source"] == "embedded"]
    assert embedded == list(catalogue.CATALOGUE)
    smol = ready_gguf(SMOL, "Q4_1", "llama", chat_template=True)
    gemma = ready_gguf(GEMMA, "Q4_K_M", "gemma3", chat_template=False)
    expected = {
        "ollama:smollm2:135m": ("ollama", smol),
        "ollama:someone/smol:latest": ("ollama", smol),
        "hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF": ("hf", smol),
        "hf:bartowski/SmolLM2-135M-Instruct-GGUF": ("hf", smol),  # Q4_K_M, the rule's choice
        "hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0": ("hf", smol),
        "hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q5_K_S": ("hf", smol),
        "hf:unsloth/gemma-3-270m-GGUF:Q8_0": ("hf", gemma),
        "hf:unsloth/gemma-3-270m-GGUF:Q6_K": ("hf", gemma),
        "lmstudio:lmstudio-community/gemma-3-270m-GGUF": ("lmstudio", gemma),
        "lmstudio:lmstudio-community/SmolLM2-135M-Instruct-GGUF": ("lmstudio", smol),
        "llamacache:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF": ("llamacache", smol),
        "llamacache:gemma-3-270m-it-qat-Q4_0.gguf": ("llamacache", gemma),
    }
    for name, (source, facts) in expected.items():
        assert rows[name]["source"] == source, name
        assert {k: rows[name][k] for k in facts} == facts, name
    for name in ("ollama:llava:7b", "ollama:imported:latest"):
        assert rows[name]["status"] == "refused" and rows[name]["detail"], name
    checkpoint = rows["transformers:hf:Qwen/tiny-chat"]
    assert (checkpoint["architecture"], checkpoint["quantisation"], checkpoint["chat_template"]) == (
        "qwen2",
        "bfloat16",
        True,
    )
    assert not any("mmproj" in n or "mlx-community" in n for n in rows)  # projectors and MLX folders are no members

    table = segfuse("models")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    for name in expected:
        assert any(name in line.split() for line in lines), name  # whole, never wrapped
        assert any(line.startswith(f"{name}: /") for line in lines), name  # its file on its own line
    assert any("base: no chat template" in line for line in lines)
    assert any(line.startswith("ollama:llava:7b: ") and "projector" in line for line in lines)
    paths = dict(line.split("\t") for line in segfuse("models", "--paths").stdout.splitlines())
    assert Path(paths["ollama:smollm2:135m"]).resolve() == SMOL.resolve()


@pytest.mark.slow
def test_every_listed_name_selects_the_file_listed_with_it(home):
    rows = [r for r in list_models() if r.source != "embedded" and r.status == "ready"]
    assert len(rows) >= 12
    for row in rows:
        if row.name.startswith("transformers:"):
            _, path, _ = resolve(row.name.removeprefix("transformers:"), checkpoint=True)
        else:
            _, path, _ = resolve(row.name)
        assert str(path) == row.path, row.name


# --- names as the tools write them ----------------------------------------------------------------


def test_names_as_each_tool_writes_them(home):
    ollama_blob = home / ".ollama" / "models" / "blobs" / f"sha256-{SMOL_SPEC.sha256}"
    for name in (
        "ollama:smollm2:135m",
        "ollama:library/smollm2:135m",
        "ollama:registry.ollama.ai/library/smollm2:135m",
        "ollama:SmolLM2:135M",
        "ollama:someone/smol",
        "ollama:someone/smol:latest",
    ):
        _label, path, prompt = resolve(name)
        assert path == ollama_blob and prompt is None, name
    assert resolve("ollama:smollm2:135m")[0] == "smollm2:135m"  # the member's display name

    snapshot = home / ".cache" / "huggingface" / "hub" / "models--bartowski--SmolLM2-135M-Instruct-GGUF" / "snapshots"
    picked = {
        name: resolve(name)[1]
        for name in (
            "hf:bartowski/SmolLM2-135M-Instruct-GGUF",
            "hf:bartowski/SmolLM2-135M-Instruct-GGUF:q8_0",
            "hf:bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q5_K_S.gguf",
        )
    }
    assert [p.name for p in picked.values()] == [
        "SmolLM2-135M-Instruct-Q4_K_M.gguf",
        "SmolLM2-135M-Instruct-Q8_0.gguf",
        "SmolLM2-135M-Instruct-Q5_K_S.gguf",
    ]
    assert all(p.parent == snapshot / REV for p in picked.values())
    assert resolve("hf:bartowski/SmolLM2-135M-Instruct-GGUF")[0] == "SmolLM2-135M-Instruct-Q4_K_M"

    assert resolve("lmstudio:lmstudio-community/gemma-3-270m-GGUF")[1].resolve() == GEMMA.resolve()
    assert resolve("lmstudio:lmstudio-community/gemma-3-270m-GGUF:Q4_K_M")[1].resolve() == GEMMA.resolve()
    cached = home / ".cache" / "llama.cpp" / "HuggingFaceTB_SmolLM2-135M-Instruct-GGUF_smollm2-135m-instruct-q4_1.gguf"
    for name in (
        "llamacache:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
        "llamacache:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:latest",
    ):
        assert resolve(name)[1] == cached, name
    assert resolve("llamacache:gemma-3-270m-it-qat-Q4_0.gguf")[1].name == "gemma-3-270m-it-qat-Q4_0.gguf"


def test_a_split_model_is_one_member_named_by_its_first_file(home):
    hub = home / ".cache" / "huggingface" / "hub"
    hf_repo(hub, "ORG/split-GGUF", {f"Q4_K_M/model-Q4_K_M-0000{i}-of-00002.gguf": SMOL for i in (1, 2)})
    row = next(r for r in list_models() if r.name == "hf:ORG/split-GGUF")
    assert row.size == 2 * SMOL.stat().st_size and row.path.endswith("model-Q4_K_M-00001-of-00002.gguf")
    second = hub / "models--ORG--split-GGUF" / "snapshots" / REV / "Q4_K_M" / "model-Q4_K_M-00002-of-00002.gguf"
    second.unlink()
    error = error_of("hf:ORG/split-GGUF")
    assert error.message == f"model file not found: {second}" and "hf download ORG/split-GGUF" in error.hint


def test_the_tools_environment_variables_move_their_folders(home, tmp_path_factory, monkeypatch):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    ollama_model(elsewhere / "ollama", "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF/Q4_K_M")
    monkeypatch.setenv("OLLAMA_MODELS", str(elsewhere / "ollama"))
    blob = resolve("ollama:hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")[1]
    assert blob.parent == elsewhere / "ollama" / "blobs"
    assert "looked in " + str(elsewhere / "ollama") in error_of("ollama:smollm2:135m").message  # only there now

    hf_repo(elsewhere / "hf-home" / "hub", "ORG/in-hf-home-GGUF", {"m-Q4_K_M.gguf": SMOL})
    monkeypatch.setenv("HF_HOME", str(elsewhere / "hf-home"))
    assert resolve("hf:ORG/in-hf-home-GGUF")[1].name == "m-Q4_K_M.gguf"
    hf_repo(elsewhere / "hub-cache", "ORG/in-hub-cache-GGUF", {"m-Q8_0.gguf": SMOL})
    monkeypatch.setenv("HF_HUB_CACHE", str(elsewhere / "hub-cache"))  # wins over HF_HOME, as in huggingface_hub
    assert resolve("hf:ORG/in-hub-cache-GGUF")[1].name == "m-Q8_0.gguf"
    assert "closest" in error_of("hf:ORG/in-hf-home-GGUF").hint

    # llama.cpp since 2026 keeps the hub layout in $LLAMA_CACHE
    hf_repo(elsewhere / "llama-cache", "ggml-org/SmolLM2-135M-GGUF", {"SmolLM2-135M-Q4_1.gguf": SMOL})
    monkeypatch.setenv("LLAMA_CACHE", str(elsewhere / "llama-cache"))
    assert resolve("llamacache:ggml-org/SmolLM2-135M-GGUF")[1].name == "SmolLM2-135M-Q4_1.gguf"

    # LM Studio: a moved home (~/.lmstudio-home-pointer) whose settings move the models folder
    lm_home, moved = elsewhere / "lm-home", elsewhere / "lm-models"
    lm_home.mkdir()
    (lm_home / "settings.json").write_text(json.dumps({"downloadsFolder": str(moved)}))
    (home / ".lmstudio-home-pointer").write_text(str(lm_home))
    lmstudio_model(moved, "pub/moved-GGUF", {"moved-Q4_1.gguf": SMOL})
    assert resolve("lmstudio:pub/moved-GGUF")[1] == moved / "pub" / "moved-GGUF" / "moved-Q4_1.gguf"
    assert resolve("lmstudio:lmstudio-community/gemma-3-270m-GGUF")  # the default folder is still read


# --- choosing among quantisations -------------------------------------------------------------------


def test_several_quantisations_without_a_q4_are_an_error_listing_them(home):
    error = error_of("hf:unsloth/gemma-3-270m-GGUF")
    assert isinstance(error, UnknownModelError)
    assert "several GGUF models: Q6_K, Q8_0" in error.message
    assert "hf:unsloth/gemma-3-270m-GGUF:Q6_K" in error.hint and "/gemma-3-270m-Q6_K.gguf" in error.hint


def test_two_4_bit_files_and_no_q4_k_m_are_ambiguous_but_one_is_chosen(home):
    hub = home / ".cache" / "huggingface" / "hub"
    hf_repo(hub, "ORG/two-q4-GGUF", {"m-Q4_0.gguf": SMOL, "m-Q4_K_S.gguf": SMOL, "m-Q8_0.gguf": SMOL})
    assert "several GGUF models: Q4_0, Q4_K_S, Q8_0" in error_of("hf:ORG/two-q4-GGUF").message
    hf_repo(hub, "ORG/one-q4-GGUF", {"m-IQ4_XS.gguf": SMOL, "m-Q8_0.gguf": SMOL})
    assert resolve("hf:ORG/one-q4-GGUF")[1].name == "m-IQ4_XS.gguf"


def test_a_quantisation_or_file_the_repository_lacks_lists_what_it_has(home):
    error = error_of("hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q3_K_S")
    assert "has no Q3_K_S model" in error.message and "Q4_K_M, Q5_K_S, Q8_0" in error.hint
    error = error_of("hf:bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q2_K.gguf")
    assert "no model file" in error.message and "SmolLM2-135M-Instruct-Q4_K_M.gguf" in error.hint
    error = error_of("hf:bartowski/SmolLM2-135M-Instruct-GGUF/mmproj-SmolLM2-135M-Instruct-f16.gguf")
    assert "no model file" in error.message  # a projector is not a member


# --- clear errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, closest, where",
    [
        ("ollama:smollm2:136m", "ollama:smollm2:135m", ".ollama/models"),
        (
            "hf:HuggingFaceTB/SmolLM2-135M-Instruct-GUFF",
            "hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
            ".cache/huggingface/hub",
        ),
        (
            "lmstudio:lmstudio-community/gemma-3-27m-GGUF",
            "lmstudio:lmstudio-community/gemma-3-270m-GGUF",
            ".lmstudio/models",
        ),
        (
            "llamacache:HuggingFaceTB/SmolLM2-135M-Instruct",
            "llamacache:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
            ".cache/llama.cpp",
        ),
    ],
)
def test_a_name_not_found_lists_the_closest_and_where_it_looked(home, name, closest, where):
    error = error_of(name)
    assert isinstance(error, UnknownModelError)
    assert f"looked in {home}/{where}" in error.message
    assert f"closest: {closest}" in error.hint


@pytest.mark.slow
def test_the_command_line_says_it_in_one_line(home):
    done = segfuse("generate", "hi", "-m", "ollama:smollm2:136m")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "no Ollama model ollama:smollm2:136m" in done.stderr and "closest: ollama:smollm2:135m" in done.stderr


def test_a_bare_name_of_a_model_found_on_disk_is_suggested_with_its_prefix(home):
    error = error_of("smollm2:135m")
    assert "did you mean ollama:smollm2:135m" in error.hint and "known models: smollm2-135m" in error.hint


@pytest.mark.parametrize(
    "name",
    ["hf:SmolLM2-GGUF", "hf:ORG/REPO:", "lmstudio:gemma", "llamacache:a/b/c", "ollama:a/b/c/d:tag", "ollama:smollm2:"],
)
def test_a_malformed_name_says_how_to_write_it(home, name):
    error = error_of(name)
    assert "bad" in error.message and "write" in error.hint


@pytest.mark.parametrize(
    "model, extra, reason",
    [
        ("llava:7b", None, "separate projector layer"),
        ("imported:latest", None, "imported from safetensors"),
        ("lora:latest", "application/vnd.ollama.image.adapter", "LoRA adapter"),
        ("twice:latest", "application/vnd.ollama.image.model", "2 model layers"),
    ],
)
def test_an_ollama_model_that_is_not_one_gguf_is_refused_with_the_reason(home, model, extra, reason):
    if extra:
        store = home / ".ollama" / "models"
        ollama_model(
            store,
            "registry.ollama.ai/library/" + model.replace(":", "/"),
            extra=(ollama_layer(store, extra, b"GGUF, but a second file"),),
        )
    error = error_of(f"ollama:{model}")
    assert isinstance(error, ModelFileError)
    assert error.message.startswith(f"ollama:{model} cannot be a member: ") and reason in error.message


def test_an_ollama_manifest_without_a_model_layer_or_readable_json_is_refused(home):
    store = home / ".ollama" / "models"
    ollama_model(store, "registry.ollama.ai/library/empty/latest", model=None)
    assert "no model layer" in error_of("ollama:empty").message
    broken = store / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    broken.parent.mkdir(parents=True)
    broken.write_text('{"layers": [')
    assert (
        "manifest" in error_of("ollama:broken").message
        and "ollama pull broken:latest" in error_of("ollama:broken").hint
    )


def _unreadable(path: Path) -> None:
    """A file that exists but cannot be read. Root reads any file whatever its mode, so there it is
    /proc/self/mem, a regular file whose offset 0 cannot be read (EIO)."""
    if os.geteuid() == 0:
        path.unlink()
        os.symlink("/proc/self/mem", path)
    else:
        path.write_bytes(b"GGUF")
        path.chmod(0)


@pytest.mark.parametrize("damage", ["not GGUF", "missing", "unreadable", "truncated"])
def test_a_bad_blob_gets_the_error_of_a_bad_gguf_path(home, tmp_path_factory, damage):
    store = home / ".ollama" / "models"
    bad = tmp_path_factory.mktemp("bad") / "blob"
    bad.write_bytes(SMOL.read_bytes()[:300_000] if damage == "truncated" else b"<html>rate limited</html>")
    SHA256[bad] = hashlib.sha256(b"bad blob").hexdigest()
    ollama_model(store, "registry.ollama.ai/library/bad/latest", model=bad)
    blob = store / "blobs" / f"sha256-{SHA256[bad]}"
    if damage == "missing":
        blob.unlink()
    elif damage == "unreadable":
        _unreadable(blob)
    error = error_of("ollama:bad")
    assert isinstance(error, ModelFileError)
    assert error.hint == "ollama:bad:latest: download it again: ollama pull bad:latest"
    if damage == "truncated":  # llama.cpp would only say "could not load": the header says how much is missing
        assert error.message.startswith(f"{blob} is truncated")
        return
    with pytest.raises(ModelFileError) as by_path:
        check_gguf(blob)  # what the llama.cpp backend says of a .gguf path
    assert error.message == by_path.value.message


def test_a_checkpoint_repository_is_no_gguf_member_but_loads_with_transformers(home):
    error = error_of("hf:Qwen/tiny-chat")
    assert "holds no GGUF file" in error.message and "transformers:hf:Qwen/tiny-chat" in error.hint
    label, folder, _ = resolve("hf:Qwen/tiny-chat", checkpoint=True)
    assert folder.is_dir() and (folder / "config.json").is_file() and label == "tiny-chat"


def test_a_folder_without_gguf_files_is_refused(home):
    error = error_of("lmstudio:mlx-community/SmolLM2-135M-Instruct-4bit")
    assert "holds no GGUF model file" in error.message and "MLX" in error.hint


def test_a_projector_named_as_a_file_is_refused(home):
    projector = home / "projector.gguf"  # what llama.cpp's converters write for a vision projector
    _write_gguf(projector, {"general.architecture": "clip", "general.type": "mmproj"})
    lmstudio_model(home / ".lmstudio" / "models", "pub/vision-GGUF", {"vision-projector-f16.gguf": projector})
    assert "multimodal projector" in error_of("lmstudio:pub/vision-GGUF").message


def _write_gguf(path: Path, values: dict[str, str]) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), values["general.architecture"])
    for key, value in values.items():
        if key != "general.architecture":
            writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- the models at work ------------------------------------------------------------------------------


@pytest.mark.models  # llama.cpp reads each file's template
def test_template_sources_read_sourced_models(home):
    """`remote:...#template=NAME`: a remote member's chat template from a model on disk."""
    from_ollama = load_prompt_source("ollama:smollm2:135m")
    assert from_ollama.template == load_prompt_source(str(SMOL)).template and "<|im_start|>" in from_ollama.template
    from_hf = load_prompt_source("hf:Qwen/tiny-chat")  # a cached tokenizer folder, no weights needed
    assert from_hf.template.startswith("{% for m in messages %}") and from_hf.eos_text == "<|im_end|>"
    base = load_prompt_source("lmstudio:lmstudio-community/gemma-3-270m-GGUF")
    assert base.prompt.style == "plain"  # a base model: Question/Answer


@pytest.mark.models
def test_generate_with_members_named_each_way(home):
    """The same SmolLM2 file named through every tool answers exactly as the embedded model does."""
    run = [
        "generate",
        "What is the capital of France?",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--threads",
        "1",
        "--json",
    ]
    alone = segfuse(*run, "-m", "smollm2-135m")
    assert alone.returncode == 0, alone.stderr
    names = [
        "ollama:smollm2:135m",
        "hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
        "lmstudio:lmstudio-community/SmolLM2-135M-Instruct-GGUF",
        "llamacache:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
    ]
    fused = segfuse(*run, *[arg for name in names for arg in ("-m", name)])
    assert fused.returncode == 0, fused.stderr
    result = json.loads(fused.stdout)
    assert result["models"] == [
        "smollm2:135m",
        "smollm2-135m-instruct-q4_1",
        "SmolLM2-135M-Instruct-Q4_1",
        "smollm2-135m-instruct-q4_1#2",
    ]
    assert result["text"] and result["text"] == json.loads(alone.stdout)["text"]


@pytest.mark.models
def test_a_cached_checkpoint_is_a_transformers_member(home):
    """`-m transformers:hf:ORG/REPO`: a checkpoint from the Hugging Face cache, loaded by transformers."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from segfuse import Ensemble
    from segfuse.backends.registry import load_member
    from segfuse.backends.transformers.load import convert_gguf, pick_dtype

    checkpoint = convert_gguf(SMOL, pick_dtype("auto", "cpu"), None)  # SmolLM2 as a plain checkpoint (cached)
    hf_repo(
        home / ".cache" / "huggingface" / "hub",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        {f.name: f for f in checkpoint.iterdir() if f.is_file()},
    )
    member = load_member("transformers:hf:HuggingFaceTB/SmolLM2-135M-Instruct", threads=1)
    with Ensemble([member]) as ensemble:
        result = ensemble.generate("What is the capital of France?", max_tokens=8, temperature=0)
    assert result.models == ["SmolLM2-135M-Instruct"] and "Paris" in result.text
