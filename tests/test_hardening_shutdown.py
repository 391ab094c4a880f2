"""`segfuse serve` stops promptly on SIGTERM, even mid-generation: the open stream ends with an error frame
(the worker stops its jobs first) instead of running on until uvicorn's graceful-shutdown timeout cuts it."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from helpers import API_KEY
from segfuse import models as catalogue
from segfuse.bench.common.processes import segfuse_server
from streams import data_frames, stream_chat

pytestmark = [pytest.mark.models, pytest.mark.timeout(300)]

MEMBER = "smollm2-135m"
GRACEFUL_S = 30  # uvicorn's timeout_graceful_shutdown: how long a stream could hold the shutdown up before


def test_sigterm_ends_an_open_stream_with_an_error_frame_and_the_process_exits(tmp_path):
    if not catalogue.is_ready(catalogue.CATALOGUE[MEMBER]):
        pytest.fail(f"model not prepared: {MEMBER}; run `make models`", pytrace=False)
    config = {"server": {"api_key": API_KEY, "max_concurrent": 1}, "members": {"models": [MEMBER], "threads": 1}}
    with segfuse_server(tmp_path, "shutdown", config) as server:
        body = {
            "messages": [{"role": "user", "content": "Count from 1 to 1000."}],
            "max_tokens": 1000,
            "stream": True,
            "temperature": 0,
            "segfuse": {"ignore_eos": True},
        }
        frames: list[str] = []
        with stream_chat(server, body, timeout=120) as response:
            assert response.status_code == 200
            for frame in data_frames(response):
                frames.append(frame)
                if len(frames) == 4:  # role, prompt sizes, then segments: it is generating
                    server.process.send_signal(signal.SIGTERM)
        try:
            code = server.process.wait(GRACEFUL_S - 10)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit after SIGTERM:\n" + server.log_tail())
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "shutting_down", frames[-3:]
    finished = [json.loads(f) for f in frames[:-2]]
    assert not any(c["choices"] and c["choices"][0].get("finish_reason") for c in finished)  # cut short
    assert code in (0, -signal.SIGTERM), server.log_tail()
