"""The PGO profile's committed form (xz) and the form rustc reads (Makefile,
`build` and `pgo-profile`).

usage: pgo_profile.py pack PROFDATA PROFDATA.xz
       pgo_profile.py unpack PROFDATA.xz PROFDATA

`unpack` writes PROFDATA only when its bytes differ from what is there:
rustc lists the profile among every crate's inputs, so rewriting the same
bytes would rebuild every crate of the `dist` binary.
"""

import lzma
import sys
from pathlib import Path


def main() -> None:
    mode, source, target = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    data = source.read_bytes()
    if mode == "pack":
        target.write_bytes(lzma.compress(data, preset=9))
    elif mode == "unpack":
        data = lzma.decompress(data)
        if not target.exists() or target.read_bytes() != data:
            target.write_bytes(data)
    else:
        sys.exit(f"unknown mode {mode!r}: pack or unpack")


if __name__ == "__main__":
    main()
