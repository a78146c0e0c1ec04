"""Streaming safetensors: the tensors' own memory sent as one file, no copy
into one bytes object; and the bounded reader."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import CorruptionError
from ..protocol.canonical import no_duplicate_keys

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

    Tensors must be contiguous CPU tensors; their memory is streamed as is,
    in the dict's order (the header lists them in that order too, and
    :func:`tensors_from_buffer` returns them by offset: in the same order).
    """
    header: dict[str, Any] = {}
    offset = 0
    order = list(tensors)
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


#: tensors at least this large are handed out as views of the read buffer; smaller ones are copied
MIN_VIEW_BYTES = 1 << 20
#: the largest safetensors header read (the format's own readers use the same bound)
MAX_HEADER = 100 * 1024 * 1024


def _entries(header: Any, data_len: int) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """Strictly checked tensor entries: known dtype, integer shape, offsets
    that match the shape and tile the data section exactly."""
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    out = []
    for name, e in header.items():
        if name == "__metadata__":
            if not isinstance(e, dict) or not all(isinstance(v, str) for v in e.values()):
                raise ValueError("__metadata__ is not a string table")
            continue
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"tensor {name!r}: entry is not {{dtype, shape, data_offsets}}")
        dtype = ST_TO_DTYPE.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        shape, offs = e["shape"], e["data_offsets"]
        if dtype is None:
            raise ValueError(f"tensor {name!r}: unknown dtype {e['dtype']!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**53 for d in shape):
            raise ValueError(f"tensor {name!r}: bad shape")
        if not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs):
            raise ValueError(f"tensor {name!r}: bad data_offsets")
        numel = 1
        for d in shape:
            numel *= d
        begin, end = offs
        if not 0 <= begin <= end <= data_len or end - begin != numel * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: data_offsets [{begin}, {end}) do not match its shape and the data")
        out.append((name, dtype, shape, begin, end))
    out.sort(key=lambda x: (x[3], x[4]))
    at = 0
    for name, _d, _s, begin, end in out:
        if begin != at:
            raise ValueError(f"tensor {name!r}: data overlaps another tensor or leaves a gap")
        at = end
    if at != data_len:
        raise ValueError(f"{data_len - at} bytes of data belong to no tensor")
    return out


Entry = tuple[str, torch.dtype, list[int], int, int]


def header_span(head: bytes, size: int) -> int:
    """How many leading bytes of a safetensors file of ``size`` bytes hold its
    header (the 8-byte length field included), from at least its first 8
    bytes ``head``; a length past the file or :data:`MAX_HEADER` is a
    :class:`CorruptionError`."""
    if size < 8 or len(head) < 8:
        raise CorruptionError(f"safetensors component cannot be parsed: {size} bytes is shorter than the header length field")
    hlen = struct.unpack("<Q", head[:8])[0]
    if hlen > min(MAX_HEADER, size - 8):
        raise CorruptionError(f"safetensors component cannot be parsed: header length {hlen} exceeds the file "
                              f"({size} bytes) or the bound")
    return 8 + int(hlen)


def parse_layout(head: bytes, size: int) -> tuple[int, list[Entry]]:
    """(offset of the data section, the tensor entries in data order) of a
    safetensors file of ``size`` bytes whose first bytes are ``head`` (at
    least :func:`header_span` of them). The header is parsed strictly
    (bounded size, no duplicate keys, known dtypes, offsets that match the
    shapes and tile the data exactly); anything else is :class:`CorruptionError`."""
    start = header_span(head, size)
    if len(head) < start:
        raise ValueError(f"{len(head)} bytes given of a header of {start}")
    try:
        header = json.loads(bytes(head[8:start]).decode("utf-8"), object_pairs_hook=no_duplicate_keys)
        return start, _entries(header, size - start)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptionError(f"safetensors component cannot be parsed: {exc}") from None


def check_bools(name: str, t: torch.Tensor) -> None:
    """A bool tensor's bytes are 0 or 1 (any other byte is no bool torch can hold)."""
    if t.dtype == torch.bool and t.numel() and bool((t.reshape(-1).view(torch.uint8) > 1).any()):
        raise CorruptionError(f"safetensors component cannot be parsed: tensor {name!r}: a bool holds a value "
                              "other than 0 or 1")


def tensors_from_buffer(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``buf`` (1-D uint8, CPU): a
    tensor of at least :data:`MIN_VIEW_BYTES` is a view of ``buf``'s memory
    (no copy); a smaller one, or one whose offset is not aligned to its
    element size, gets its own memory (some torch APIs, e.g.
    ``Generator.set_state``, read a tensor's storage from its start and would
    misread a view). The header is parsed as :func:`parse_layout` does;
    anything malformed is :class:`CorruptionError`."""
    n = buf.numel()
    head = buf[: min(n, 8)].numpy().tobytes()
    start = header_span(head, n)
    start, entries = parse_layout(buf[:start].numpy().tobytes(), n)
    try:
        out: dict[str, torch.Tensor] = {}
        for name, dtype, shape, begin, end in entries:
            raw = buf[start + begin : start + end]
            if (start + begin) % dtype.itemsize or end - begin < MIN_VIEW_BYTES:
                raw = raw.clone()
            t = raw.view(dtype).view(shape)
            check_bools(name, t)
            out[name] = t
        return out
    except (ValueError, RuntimeError) as exc:
        raise CorruptionError(f"safetensors component cannot be parsed: {exc}") from None


def load_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file given as bytes (copied once into tensor memory)."""
    if not data:
        raise CorruptionError("safetensors component cannot be parsed: it is empty")
    return tensors_from_buffer(torch.frombuffer(bytearray(data), dtype=torch.uint8))
