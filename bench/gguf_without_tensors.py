"""A GGUF's header and metadata without its tensors: the tokenizer and the chat
template only (SmolLM2's 98 MB become 1.8 MB), for a gateway in front of remote
workers, which reads no weights: e.g. `sluice bench gateway --model` on a
machine the model file cannot be copied to (BENCHMARKS.md, "The same benchmark
on a second machine"). backend/tests/smollm2.rs checks the copy tokenizes and
templates as the original.

usage: python3 bench/gguf_without_tensors.py MODEL.gguf OUT.gguf
"""
import struct
import sys

# GGUF metadata value types (version 2 and 3) of fixed size: uint8, int8,
# uint16, int16, uint32, int32, float32, bool, uint64, int64, float64.
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


def skip_value(b, kind, off):
    """The offset just past a value of type `kind` starting at `off`."""
    if kind in FIXED_SIZES:
        return off + FIXED_SIZES[kind]
    if kind == STRING:
        (n,) = struct.unpack_from("<Q", b, off)
        return off + 8 + n
    if kind == ARRAY:
        item, n = struct.unpack_from("<IQ", b, off)
        off += 12
        if item in FIXED_SIZES:
            return off + n * FIXED_SIZES[item]
        for _ in range(n):
            off = skip_value(b, item, off)
        return off
    raise ValueError(f"unknown GGUF value type {kind}")


def main(src, dst):
    b = open(src, "rb").read()
    if b[:4] != b"GGUF":
        sys.exit(f"{src} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", b, 4)
    if version < 2:
        sys.exit(f"{src}: GGUF version {version} (32-bit counts) is not read here")
    off = 24
    for _ in range(n_kv):  # key (a string), value type, value
        (key_len,) = struct.unpack_from("<Q", b, off)
        off += 8 + key_len
        (kind,) = struct.unpack_from("<I", b, off)
        off = skip_value(b, kind, off + 4)
    out = bytearray(b[:off])
    struct.pack_into("<Q", out, 8, 0)  # the tensor count; their infos and data are left out
    out += b"\0" * ((-len(out)) % 32)
    open(dst, "wb").write(out)
    print(f"{dst}: {n_kv} metadata entries, {n_tensors} tensors left out, {len(out)} bytes")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
