"""What a GGUF file says about itself, read from its header without touching tensor data.

The key/value header and the tensor table are read by hand from a memory map.
``gguf.GGUFReader`` would do it too, but it builds a numpy view for every element
of every array, and a vocabulary is hundreds of thousands of strings: it took
3.6 s on the 100 MB SmolLM2 file and 11-15 s on the 0.5B Qwen and 270M Gemma
files here, against well under a second by hand. The ``gguf`` package still
supplies the tables this needs (tensor type sizes, file type names).

The errors say what ``models.check_gguf`` says of a bad ``.gguf``
path (not found, cannot read, not a GGUF file), so a bad file found through a
model store reads like a bad file given by hand; this module adds a check for
truncated files (shorter than their own tensor table says).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFileError

MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_KEYS = {  # the header values this module keeps; every other value is skipped unread
    "general.architecture",
    "general.name",
    "general.file_type",
    "general.type",
    "general.alignment",
    "split.count",
    "tokenizer.chat_template",
}
BAD_FILE_HINT = "give a .gguf model file (llama.cpp format)"


@dataclass(frozen=True)
class GGUFInfo:
    """A GGUF file's identity: what `segfuse models` shows and resolution checks."""

    path: Path
    size: int  # bytes on disk
    architecture: str  # general.architecture, e.g. "llama", "qwen2"
    quantisation: str | None  # from general.file_type, e.g. "Q4_K_M"; None when undeclared
    title: str | None  # general.name
    chat_template: str | None  # tokenizer.chat_template; None for base models
    kind: str  # general.type: "model", or "mmproj" for a multimodal projector
    splits: int  # split.count: 1 for a whole model, N for the first of N shards


class _Truncated(Exception):
    """The header or tensor table runs past the end of the file."""


class _Header:
    """A cursor over the mapped header; every read checks the bounds."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos, self.end = data, 0, len(data)

    def scalar(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        if self.pos + size > self.end:
            raise _Truncated
        value: int | float | bool = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        length = int(self.scalar("<Q"))
        if self.pos + length > self.end:
            raise _Truncated
        text = self.data[self.pos : self.pos + length].decode("utf-8", "replace")
        self.pos += length
        return text

    def value(self, vtype: int, keep: bool) -> object:
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == _STRING:
            if keep:
                return self.string()
            self._skip_strings(1)
            return None
        if vtype == _ARRAY:
            self._skip_array()
            return None
        raise _Truncated  # an unknown type id: the header is garbage from here on

    def _skip_strings(self, count: int) -> None:
        # A vocabulary is ~10^5 strings: keep this loop tight (locals, no method calls).
        data, pos, end, unpack = self.data, self.pos, self.end, struct.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise _Truncated
            pos += 8 + unpack("<Q", data, pos)[0]
        if pos > end:
            raise _Truncated
        self.pos = pos

    def _skip_array(self) -> None:
        etype, count = int(self.scalar("<I")), int(self.scalar("<Q"))
        if etype in _SCALAR:
            self.pos += count * struct.calcsize(_SCALAR[etype])
            if self.pos > self.end:
                raise _Truncated
        elif etype == _STRING:
            self._skip_strings(count)
        else:
            for _ in range(count):
                self.value(etype, keep=False)


def _quantisation(file_type: object) -> str | None:
    """general.file_type's enum value as the name people use: 15 -> "Q4_K_M"."""
    from gguf.constants import LlamaFileType

    if not isinstance(file_type, int):
        return None
    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return f"type {file_type}"
    if name == "GUESSED":
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _data_end(header: _Header, tensors: int, alignment: int) -> int:
    """Bytes the file needs: the tensor table, padding, then the furthest tensor's last byte."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    furthest = 0
    for _ in range(tensors):
        header._skip_strings(1)  # the tensor's name
        dims = [int(header.scalar("<Q")) for _ in range(int(header.scalar("<I")))]
        ttype, offset = int(header.scalar("<I")), int(header.scalar("<Q"))
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            continue  # a type newer than the gguf package: its size is unknown, skip it
        elements = 1
        for d in dims:
            elements *= d
        furthest = max(furthest, offset + elements // block * type_size)
    start = -(-header.pos // alignment) * alignment
    return start + furthest


def _parse(path: Path, data: mmap.mmap, size: int) -> GGUFInfo:
    header = _Header(data)
    header.pos = 4
    version = int(header.scalar("<I"))
    if version not in (2, 3):
        raise ModelFileError(
            f"{path} is GGUF version {version}, which llama.cpp does not read",
            "convert it again with a current llama.cpp",
        )
    tensors, count = int(header.scalar("<Q")), int(header.scalar("<Q"))
    values: dict[str, object] = {}
    for _ in range(count):
        key = header.string()
        vtype = int(header.scalar("<I"))
        value = header.value(vtype, keep=key in _KEYS)
        if key in _KEYS:
            values[key] = value
    alignment = values.get("general.alignment")
    needed = _data_end(header, tensors, alignment if isinstance(alignment, int) and alignment > 0 else 32)
    if size < needed:
        raise _Truncated(f"{size} of {needed} bytes")

    def text(key: str) -> str | None:
        value = values.get(key)
        return value if isinstance(value, str) else None

    splits = values.get("split.count")
    return GGUFInfo(
        path=path,
        size=size,
        architecture=text("general.architecture") or "?",
        quantisation=_quantisation(values.get("general.file_type")),
        title=text("general.name"),
        chat_template=text("tokenizer.chat_template") or None,
        kind=text("general.type") or "model",
        splits=int(splits) if isinstance(splits, int) and splits > 0 else 1,
    )


def read_gguf(path: Path, hint: str | None = None) -> GGUFInfo:
    """Read `path`'s header; raise ModelFileError if it is missing, unreadable, not GGUF or truncated.

    `hint` replaces the generic advice, e.g. with how to download a model again.
    """
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}", hint or "check the path")
    try:
        with path.open("rb") as handle:
            if handle.read(4) != MAGIC:
                raise ModelFileError(f"{path} is not a GGUF file", hint or BAD_FILE_HINT)
            size = path.stat().st_size
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse(path, data, size)
    except OSError as exc:
        raise ModelFileError(
            f"cannot read {path}: {exc.strerror or exc}", hint or "check the file's permissions"
        ) from None
    except _Truncated as exc:
        detail = f" ({exc})" if str(exc) else " (its header ends early)"
        raise ModelFileError(
            f"{path} is truncated{detail}", hint or "the file is corrupt or was cut short; replace it"
        ) from None
