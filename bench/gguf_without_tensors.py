"""A GGUF's header and metadata without its tensors: the tokenizer and the chat
template only (SmolLM2's 98 MB become 1.8 MB), for a gateway in front of remote
workers, which reads no weights: e.g. `sluice bench gateway --model` on a
machine the model file cannot be copied to (BENCHMARKS.md, "The same benchmark
on a second machine").

usage: python3 bench/gguf_without_tensors.py MODEL.gguf OUT.gguf
"""
import struct, sys
src, dst = sys.argv[1], sys.argv[2]
b = open(src, "rb").read()
assert b[:4] == b"GGUF"
version, n_tensors, n_kv = struct.unpack_from("<IQQ", b, 4)
off = 24
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def skip_value(t, off):
    if t in SIZES:
        return off + SIZES[t]
    if t == 8:
        (n,) = struct.unpack_from("<Q", b, off)
        return off + 8 + n
    if t == 9:
        et, n = struct.unpack_from("<IQ", b, off)
        off += 12
        if et in SIZES:
            return off + n * SIZES[et]
        for _ in range(n):
            off = skip_value(et, off)
        return off
    raise ValueError(t)
for _ in range(n_kv):
    (klen,) = struct.unpack_from("<Q", b, off)
    off += 8 + klen
    (t,) = struct.unpack_from("<I", b, off)
    off = skip_value(t, off + 4)
out = bytearray(b[:off])
struct.pack_into("<Q", out, 8, 0)  # no tensors
out += b"\0" * ((-len(out)) % 32)
open(dst, "wb").write(out)
print(f"{dst}: {n_kv} metadata entries, {n_tensors} tensors left out, {len(out)} bytes")
