"""nnsx.py edit IN OUT CODE: the artifact IN with its header (the JSON, as `h`) changed by
the Python statements CODE, written to OUT with the header's checksum made right (the
sections untouched): artifacts crafted to test what the reader checks beyond its
checksums. nnsx.py replace IN OUT OLD NEW: the first OLD in the header's text made NEW."""
import json
import struct
import sys


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def split(raw):
    (n,) = struct.unpack("<Q", raw[8:16])
    return raw[:8], raw[24:24 + n], raw[24 + n:]


def join(head, header, rest):
    return head + struct.pack("<QQ", len(header), fnv1a64(header)) + header + rest


def main():
    cmd, src, dst = sys.argv[1:4]
    head, header, rest = split(open(src, "rb").read())
    if cmd == "edit":
        h = json.loads(header)
        exec(sys.argv[4], {"h": h})
        header = json.dumps(h, indent=1).encode()
    elif cmd == "replace":
        header = header.replace(sys.argv[4].encode(), sys.argv[5].encode(), 1)
    else:
        sys.exit(__doc__)
    open(dst, "wb").write(join(head, header, rest))


if __name__ == "__main__":
    main()
