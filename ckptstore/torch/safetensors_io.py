"""Streaming safetensors: the tensors' own memory sent as one file, no copy
into one bytes object; and the bounded reader."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import CorruptionError

DTYPE_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _st in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e4m3fn", "F8_E4M3"),
                   ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_TO_ST[getattr(torch, _name)] = _st
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}

#: The only dtypes a ``{"__dtype": NAME}`` tag may name. Decoding looks NAME up
#: here and nowhere else: never ``getattr(torch, NAME)``, which would hand a
#: hostile save any attribute of the torch module (functions included).
DTYPE_BY_NAME: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    _d = getattr(torch, _name, None)  # build time, fixed names: the table, not the save, decides
    if isinstance(_d, torch.dtype):
        DTYPE_BY_NAME[_name] = _d

# --------------------------------------------------------------- safetensors


def _raw_view(t: torch.Tensor) -> memoryview:
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def safetensors_stream(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[int, Iterator[memoryview]]:
    """(total size, buffers) of a safetensors file holding ``tensors``.

    Tensors must be contiguous CPU tensors; their memory is streamed as is.
    """
    header: dict[str, Any] = {}
    offset = 0
    order = sorted(tensors)
    for k in order:
        t = tensors[k]
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"tensor {k!r} must be contiguous on the CPU before streaming")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": DTYPE_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    total = 8 + len(hb) + offset

    def gen() -> Iterator[memoryview]:
        yield memoryview(struct.pack("<Q", len(hb)) + hb)
        for k in order:
            if tensors[k].numel():
                yield _raw_view(tensors[k])

    return total, gen()


def load_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as exc:  # noqa: BLE001 - report as corruption, never a deep traceback
        raise CorruptionError(f"safetensors component cannot be parsed: {exc}") from None
