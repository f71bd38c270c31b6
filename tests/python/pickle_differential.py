"""Writes random data-only objects, as CPython pickles them, for the reader's differential test.

Usage: pickle_differential.py OUT_FILE SEED COUNT
Each record: protocol (1 byte), canonical text of the object (4-byte length + UTF-8), pickle (4-byte
length + bytes). The canonical text is what the C++ side renders from its own parse: equal texts mean
equal values. Objects use the types a PyTorch snapshot holds: None, bool, int of every width and sign
that fits [-2^63, 2^64), float, str, bytes (protocol 3 and later: protocol 2 pickles bytes through a
function call, which the safe reader refuses by design), list, tuple, dict; shared references too.
"""
import pickle
import random
import struct
import sys


def canon(x):
    if x is None:
        return "N"
    if x is True:
        return "T"
    if x is False:
        return "F"
    if isinstance(x, int):
        return "i%d" % x
    if isinstance(x, float):
        return "f%.17g" % x
    if isinstance(x, str):
        return "s%d:%s" % (len(x.encode()), x)
    if isinstance(x, bytes):
        return "b%d:%s" % (len(x), x.hex())
    if isinstance(x, list):
        return "[" + ",".join(canon(v) for v in x) + "]"
    if isinstance(x, tuple):
        return "(" + ",".join(canon(v) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ",".join(canon(k) + ":" + canon(v) for k, v in x.items()) + "}"
    raise TypeError(type(x))


def rand_int(r):
    bits = r.choice([1, 7, 8, 15, 16, 31, 32, 33, 62, 63, 64])
    v = r.getrandbits(bits)
    if bits == 64:
        return v  # [0, 2^64): the unsigned range PyTorch can write
    return -v if r.random() < 0.4 else v


def rand_obj(r, depth, protocol, shared):
    kinds = ["none", "bool", "int", "int", "float", "str"] + (["bytes"] if protocol >= 3 else [])
    if depth < 4:
        kinds += ["list", "tuple", "dict", "shared"]
    k = r.choice(kinds)
    if k == "none":
        return None
    if k == "bool":
        return r.random() < 0.5
    if k == "int":
        return rand_int(r)
    if k == "float":
        return r.choice([0.0, -1.5, 1e300, 2.0 ** -1074, r.uniform(-1e6, 1e6)])
    if k == "str":
        return "".join(r.choice("ab_/.:é中") for _ in range(r.randrange(0, 12)))
    if k == "bytes":
        return bytes(r.getrandbits(8) for _ in range(r.randrange(0, 9)))
    if k == "list":
        return [rand_obj(r, depth + 1, protocol, shared) for _ in range(r.choice([0, 1, 3, 999, 1001, 2500]) if depth == 0 else r.randrange(0, 5))]
    if k == "tuple":
        return tuple(rand_obj(r, depth + 1, protocol, shared) for _ in range(r.randrange(0, 6)))
    if k == "dict":
        n = r.choice([0, 1, 4, 1001]) if depth == 0 else r.randrange(0, 5)
        return {("k%d" % i if r.random() < 0.8 else rand_int(r)): rand_obj(r, depth + 1, protocol, shared) for i in range(n)}
    if not shared:
        shared.append(["shared", rand_int(r)])
    return shared[0]


def main():
    out, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    r = random.Random(seed)
    with open(out, "wb") as f:
        for n in range(count):
            protocol = 2 + n % 4
            obj = rand_obj(r, 0, protocol, [])
            data = pickle.dumps(obj, protocol=protocol)
            text = canon(obj).encode()
            f.write(struct.pack("<BI", protocol, len(text)) + text + struct.pack("<I", len(data)) + data)


if __name__ == "__main__":
    main()
