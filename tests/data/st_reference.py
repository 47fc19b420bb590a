#!/usr/bin/env python3
"""st_reference.py - an independent safetensors writer and checker for the
tests, using only json and struct.

  st_reference.py write OUT    writes tensors with known values (below)
  st_reference.py verify FILE  checks a file written by meshrun: layout rules
                               and the values of the tensors named below

Values (i = row-major element index):
  f32  F32  [3, 4]     i * 0.5 - 2
  bf16 BF16 [2, 3, 5]  (i - 15) * 0.25        (exact in bfloat16)
  f16  F16  [4, 2]     (i - 7) / 8            (exact in half)
  i64  I64  [3]        i * 10**12 - 7
  u8   U8   [5]        250 + i
  scalar F32 []        3.25
metadata {"format": "pt", "note": "reference"}.
The writer puts tensors in the data buffer in an order unlike their JSON
order, to show that readers go by data_offsets."""
import json
import struct
import sys

SPECS = [
    ("f32", "F32", [3, 4], lambda i: i * 0.5 - 2),
    ("bf16", "BF16", [2, 3, 5], lambda i: (i - 15) * 0.25),
    ("f16", "F16", [4, 2], lambda i: (i - 7) / 8),
    ("i64", "I64", [3], lambda i: i * 10**12 - 7),
    ("u8", "U8", [5], lambda i: 250 + i),
    ("scalar", "F32", [], lambda i: 3.25),
]
SIZE = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "U8": 1, "F64": 8, "I32": 4,
        "U16": 2}


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def encode(dtype, v):
    if dtype == "F32":
        return struct.pack("<f", v)
    if dtype == "BF16":
        return struct.pack("<f", v)[2:]  # exact values: truncation is exact
    if dtype == "F16":
        return struct.pack("<e", v)
    if dtype == "I64":
        return struct.pack("<q", v)
    if dtype == "U8":
        return struct.pack("<B", v)
    raise ValueError(dtype)


def decode(dtype, b):
    if dtype == "F32":
        return struct.unpack("<f", b)[0]
    if dtype == "BF16":
        return struct.unpack("<f", b"\0\0" + b)[0]
    if dtype == "F16":
        return struct.unpack("<e", b)[0]
    if dtype == "I64":
        return struct.unpack("<q", b)[0]
    if dtype == "U8":
        return b[0]
    raise ValueError(dtype)


def write(path):
    blobs = {}
    for name, dtype, shape, fn in SPECS:
        blobs[name] = b"".join(encode(dtype, fn(i)) for i in range(numel(shape)))
    # data order: 8-byte types first, then the rest reversed
    order = ["i64", "scalar", "f32", "f16", "bf16", "u8"]
    header, data = {"__metadata__": {"format": "pt", "note": "reference"}}, b""
    offsets = {}
    for name in order:
        offsets[name] = [len(data), len(data) + len(blobs[name])]
        data += blobs[name]
    for name, dtype, shape, _ in SPECS:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": offsets[name]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def verify(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0, "data buffer not 8-byte aligned"
    header = json.loads(raw[8:8 + n].decode())
    data = raw[8 + n:]
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    spans = sorted(tuple(v["data_offsets"]) for v in tensors.values())
    at = 0
    for b, e in spans:
        assert b == at, "hole or overlap at %d" % b
        at = e
    assert at == len(data), "tensors do not end at the end of the file"
    for name, t in tensors.items():
        b, e = t["data_offsets"]
        size = SIZE[t["dtype"]]
        assert b % size == 0, "%s not aligned to its element size" % name
        assert e - b == numel(t["shape"]) * size, "%s: size mismatch" % name
    for name, dtype, shape, fn in SPECS:
        t = tensors[name]
        assert t["dtype"] == dtype and t["shape"] == shape, name
        b, _ = t["data_offsets"]
        size = SIZE[dtype]
        for i in range(numel(shape)):
            got = decode(dtype, data[b + i * size:b + (i + 1) * size])
            assert got == fn(i), "%s[%d] = %r, want %r" % (name, i, got, fn(i))
    assert header["__metadata__"] == {"format": "pt", "note": "reference"}
    print("verified", path, file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "verify"):
        sys.exit("usage: st_reference.py write|verify FILE")
    (write if sys.argv[1] == "write" else verify)(sys.argv[2])
