#!/usr/bin/env python3
"""check_fortunes.py DRIVER - runs scripts/data/fortunes with the given
prepare-data binary into a temporary folder, then checks, with json/struct
only, that training + validation tokens are exactly the bytes of the sorted
fortune text files, that validation is the last ~5% starting at a line, and
that both files are llm.c uint16 token files.  Exits 77 (skip) without the
fortunes packages."""
import os
import struct
import subprocess
import sys
import tempfile

SRC = "/usr/share/games/fortunes"


def read_tokens(path):
    raw = open(path, "rb").read()
    magic, version, count = struct.unpack("<3i", raw[:12])
    assert (magic, version) == (20240520, 1), (path, magic, version)
    assert len(raw) == 1024 + 2 * count, (path, len(raw), count)
    toks = struct.unpack("<%dH" % count, raw[1024:])
    assert all(t < 256 for t in toks)
    return bytes(toks)


def main():
    if not os.path.isdir(SRC):
        sys.exit(77)
    names = sorted(n for n in os.listdir(SRC)
                   if os.path.isfile(os.path.join(SRC, n))
                   and not os.path.islink(os.path.join(SRC, n))
                   and not n.endswith((".dat", ".u8")))
    text = b"".join(open(os.path.join(SRC, n), "rb").read() for n in names)
    root = os.environ.get("MESHRUN_SOURCE_DIR", ".")
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, MESHRUN_BIN=os.path.abspath(sys.argv[1]))
        subprocess.run([os.path.join(root, "scripts/data/fortunes"), out],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        train = read_tokens(os.path.join(out, "fortunes.bin"))
        val = read_tokens(os.path.join(out, "fortunes-val.bin"))
    assert train + val == text, "tokens differ from the concatenated text"
    nominal = int(0.95 * len(text))
    assert len(train) >= nominal and text[len(train) - 1:len(train)] == b"\n"
    assert b"\n" not in text[nominal:len(train) - 1], "not the first line start"
    print("fortunes: %d train + %d val tokens from %d files"
          % (len(train), len(val), len(names)), file=sys.stderr)


main()
