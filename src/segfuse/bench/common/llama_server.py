"""`python -m segfuse.bench.common.llama_server ARGS`: llama-cpp-python's own server (``llama_cpp.server``),
with llama.cpp's extra CPU buffer types decided as for segfuse's own llama.cpp members.

Where the CPU advertises AMX but faults on it (``backends.llama_cpp.runtime.use_extra_buffer_types``), the
stock server would crash on its first batched decode; this starts the same server with the same
arguments, only loading its model as our members load theirs.
"""

from __future__ import annotations

from typing import Any

import llama_cpp.llama_cpp as native

from ...backends.llama_cpp.runtime import use_extra_buffer_types


def _with_our_buffer_types() -> None:
    stock = native.llama_model_default_params

    def default_params() -> Any:  # llama.cpp's parameter struct (ctypes)
        params = stock()
        params.use_extra_bufts = use_extra_buffer_types()
        return params

    native.llama_model_default_params = default_params


if __name__ == "__main__":
    _with_our_buffer_types()
    from llama_cpp.server.__main__ import main

    main()  # type: ignore[no-untyped-call]  # llama_cpp.server's main has no annotations
