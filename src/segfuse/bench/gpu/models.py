"""The GPU check's members: three real model shapes with random weights, each with the tokenizer of the
embedded model of its family, and a drafter's shape that the drafting rows time beside them.

Random weights time the real shapes (every matmul, the attention layout, the vocabulary's projection) with no
download: the answers are noise, so the segments differ in length from a real model's and say nothing of
quality. Each is built from its config on the device, saved as a checkpoint folder (weights, config,
tokenizer) and loaded back as a ``transformers:FOLDER#NAME,device=...,dtype=...`` member, as a user's
checkpoint would be. ``small`` shrinks every shape (2 layers, hidden 64) for a dry run on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shape:
    name: str  # the member's name
    tokenizer: str  # the embedded model whose tokenizer it takes
    config: str  # the transformers config class
    fields: dict[str, Any] = field(default_factory=dict)
    small: dict[str, Any] = field(default_factory=dict)  # its fields for a dry run


SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
SHAPES = (
    Shape(
        "qwen2.5-7b",
        "qwen2.5-coder-0.5b",
        "Qwen2Config",
        {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "rope_theta": 1e6,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
        },
        {**SMALL, "num_attention_heads": 4, "num_key_value_heads": 2},
    ),
    Shape(
        "smollm2-1.7b",
        "smollm2-135m",
        "LlamaConfig",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 24,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "max_position_embeddings": 8192,
            "rope_theta": 130000,
            "tie_word_embeddings": True,
        },
        {**SMALL, "num_attention_heads": 4, "num_key_value_heads": 4},
    ),
    Shape(
        "gemma3-1b",
        "gemma3-270m",
        "Gemma3TextConfig",
        {
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_hidden_layers": 26,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "sliding_window": 512,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
        },
        {**SMALL, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16},
    ),
)
# Drafters the drafting rows time beside the ensemble's own members (never in the ensemble): a 0.5B of the
# leader's family and vocabulary, as a same-family drafter would be.
DRAFTER_SHAPES = (
    Shape(
        "qwen2.5-0.5b",
        "qwen2.5-coder-0.5b",
        "Qwen2Config",
        {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rope_theta": 1e6,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
        },
        {**SMALL, "num_attention_heads": 4, "num_key_value_heads": 2},
    ),
)
# the embedded tokenizers the pack carries
TOKENIZERS = tuple(dict.fromkeys(s.tokenizer for s in (*SHAPES, *DRAFTER_SHAPES)))


def padded_vocab(size: int) -> int:
    """The tokenizer's size rounded up to a multiple of 64, as real checkpoints pad their embeddings."""
    return math.ceil(size / 64) * 64


def make_config(shape: Shape, tokenizer: Any, small: bool) -> Any:
    """The shape's config for `tokenizer`'s vocabulary and special tokens."""
    import transformers

    fields = {**shape.fields, **(shape.small if small else {})}
    rope = fields.pop("rope_theta", None)
    config = getattr(transformers, shape.config)(
        vocab_size=padded_vocab(len(tokenizer)),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )
    if rope is not None:
        _set_rope_theta(config, rope)
    return config


def _set_rope_theta(config: Any, theta: float) -> None:
    """RoPE's base: transformers 5 keeps it in ``rope_parameters``, 4.x as ``rope_theta``."""
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict):
        parameters["rope_theta"] = theta
    else:
        config.rope_theta = theta


def build_checkpoint(shape: Shape, tokenizer_dir: Path, folder: Path, *, device: str, dtype: str, small: bool) -> Path:
    """Random weights of `shape` made on `device` and saved with the tokenizer as a checkpoint in `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...backends.transformers.load import DTYPES

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    config = make_config(shape, tokenizer, small)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])  # type: ignore[no-untyped-call]  # untyped in transformers
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


def member_spec(folder: Path, shape: Shape, device: str, dtype: str) -> str:
    return f"transformers:{folder}#{shape.name},device={device},dtype={dtype}"
