"""Server configuration and the no-members path: no model is loaded here, so these run in seconds."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn

from segfuse.bench.common.processes import free_port
from segfuse.config import ConfigError, build_config
from segfuse.server import create_app


def write(tmp_path, text: str):
    path = tmp_path / "segfuse.toml"
    path.write_text(text)
    return path


def test_defaults_bind_loopback_without_auth(monkeypatch):
    monkeypatch.delenv("SEGFUSE_API_KEY", raising=False)
    config = build_config()
    assert (config.server.host, config.server.port, config.server.api_key) == ("127.0.0.1", 8000, None)
    assert config.members.models == [] and config.fusion_defaults().max_tokens == 256


def test_file_then_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGFUSE_API_KEY", "from-env")
    path = write(
        tmp_path,
        '[server]\nport = 9000\nqueue_size = 2\n[members]\nmodels = ["smollm2-135m"]\n'
        "[defaults]\nmax_tokens = 32\nwindow = 6\n",
    )
    config = build_config(path, port=9100)
    assert config.server.port == 9100 and config.server.queue_size == 2
    assert config.server.api_key == "from-env"  # the file sets none
    assert config.members.models == ["smollm2-135m"]
    assert (config.fusion_defaults().max_tokens, config.fusion_defaults().window) == (32, 6)
    assert build_config(path, api_key="flag").server.api_key == "flag"


def test_deterministic_is_a_default_from_the_file_or_the_flag(tmp_path):
    assert not build_config().fusion_defaults().deterministic
    assert build_config(write(tmp_path, "[defaults]\ndeterministic = true\n")).fusion_defaults().deterministic
    assert build_config(defaults={"deterministic": True}).fusion_defaults().deterministic  # serve --deterministic


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[server\nport = 1", "not valid TOML"),
        ("[server]\nprot = 8000", "server.prot: Extra inputs are not permitted"),
        ("[server]\nport = 70000", "server.port: Input should be less than or equal to 65535"),
        ('[server]\nport = "eighty"', "server.port"),
        ("[members]\nn_ctx = 10", "members.n_ctx"),
        ("[defaults]\nwindow = 0", "[defaults]"),
        ("[defaults]\nbogus = 1", "[defaults]"),
        ('[defaults]\ndeterministic = "yes"', "deterministic"),
        ("[surprise]\nx = 1", "surprise"),
    ],
)
def test_bad_config_says_where(tmp_path, text, expected):
    with pytest.raises(ConfigError) as caught:
        build_config(write(tmp_path, text))
    assert expected in str(caught.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        build_config(tmp_path / "nope.toml")


@pytest.mark.slow
def test_cli_reports_a_bad_config_in_one_line(tmp_path):
    path = write(tmp_path, "[server]\nport = -1\n")
    done = subprocess.run(
        [sys.executable, "-m", "segfuse.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "server.port" in done.stderr and "Traceback" not in done.stderr


def test_no_members_answers_503(tmp_path):
    """Members that fail to load leave the server up, saying why, with 503 on completions."""
    config = build_config(models=["/nonexistent/model.gguf"], port=free_port())
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=config.server.port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{config.server.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(f"{url}/health", timeout=5)
                if health.json()["status"] == "failed":
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not report the failed load"
            time.sleep(0.1)
        assert health.status_code == 503 and "not found" in health.json()["error"]
        answer = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "no_members"
    finally:
        server.should_exit = True
        thread.join(30)
