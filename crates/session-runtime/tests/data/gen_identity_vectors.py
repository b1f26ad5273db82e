#!/usr/bin/env python3
"""Generates identity-vectors.json: test vectors that pin the session id function.

This is an independent implementation of the session id, written only from its
specification, so the vectors do not come from the Rust code they test:

    canonical = b"openab-session-id/v1"
                + for each part in (installation, agent, platform, thread):
                      len(utf8(part)) as a 4-byte big-endian unsigned integer
                      + utf8(part)
    id = lowercase(base32(sha256(canonical)), RFC 4648 alphabet, no padding)[:20]

Usage:
    python3 gen_identity_vectors.py            # rewrite identity-vectors.json
    python3 gen_identity_vectors.py --check    # exit 1 if the file is out of date

The session id is stable forever: never change an existing vector. A new
encoding would get a new domain tag (v2) and its own vectors.
"""

import base64
import hashlib
import json
import pathlib
import struct
import sys

DOMAIN_TAG = b"openab-session-id/v1"
OUT = pathlib.Path(__file__).with_name("identity-vectors.json")


def canonical_encoding(installation, agent, platform, thread):
    out = bytearray(DOMAIN_TAG)
    for part in (installation, agent, platform, thread):
        data = part.encode("utf-8")
        out += struct.pack(">I", len(data))
        out += data
    return bytes(out)


def session_id(installation, agent, platform, thread):
    digest = hashlib.sha256(canonical_encoding(installation, agent, platform, thread)).digest()
    return base64.b32encode(digest).decode("ascii").rstrip("=").lower()[:20]


LABEL_63 = "a" + "0123456789-abcdefghijklmnopqrstuvwxyz" * 1 + "x" * 24 + "z"
assert len(LABEL_63) == 63

# (note, installation, agent, platform, thread)
CASES = [
    ("discord snowflake thread", "prod", "claude", "discord", "1234567890123456789"),
    ("slack channel and thread timestamp", "prod", "claude", "slack", "C0123ABC:1712345678.000100"),
    ("same thread, other agent", "prod", "codex", "slack", "C0123ABC:1712345678.000100"),
    ("same thread, other installation", "staging-2", "claude", "slack", "C0123ABC:1712345678.000100"),
    ("telegram supergroup topic", "prod", "claude", "telegram", "-1001234567890:42"),
    ("naive concatenation collides with the next vector (installation|agent)", "ab", "c", "discord", "1"),
    ("naive concatenation collides with the previous vector (installation|agent)", "a", "bc", "discord", "1"),
    ("naive concatenation collides with the next vector (platform|thread)", "prod", "claude", "slack", "x1"),
    ("naive concatenation collides with the previous vector (platform|thread)", "prod", "claude", "slac", "kx1"),
    ("single-character parts", "a", "b", "c", "d"),
    ("shortest parts", "0", "0", "0", "0"),
    ("longest parts: 63-byte labels, 256-byte ascii thread", LABEL_63, LABEL_63, LABEL_63, "t" * 255 + "!"),
    ("256-byte thread of 2-byte characters", "prod", "claude", "discord", "\u00e9" * 128),
    ("256-byte thread of 4-byte emoji", "prod", "claude", "discord", "\U0001f9f5" * 64),
    ("precomposed e-acute (no unicode normalization)", "prod", "claude", "matrix", "caf\u00e9"),
    ("decomposed e + combining acute (no unicode normalization)", "prod", "claude", "matrix", "cafe\u0301"),
    ("japanese thread name", "prod", "claude", "matrix", "\u30b9\u30ec\u30c3\u30c9-42"),
    ("emoji thread with variation selector", "prod", "claude", "matrix", "\U0001f9f5\U0001f680 launch \u2764\ufe0f"),
    ("path-like thread (only the id is ever used in paths)", "prod", "claude", "matrix", "../../etc/passwd"),
    ("absolute-path-like thread", "prod", "claude", "matrix", "/abs"),
    ("inner and edge spaces are kept", "prod", "claude", "irc", " #rust general "),
    ("matrix room id", "home-lab", "gemini", "matrix", "!OGEhHVWSdvArJzumhm:matrix.org"),
]


def build():
    vectors = []
    for note, installation, agent, platform, thread in CASES:
        vectors.append(
            {
                "note": note,
                "installation": installation,
                "agent": agent,
                "platform": platform,
                "thread": thread,
                "id": session_id(installation, agent, platform, thread),
            }
        )
    ids = [v["id"] for v in vectors]
    assert len(set(ids)) == len(ids), "vector ids must be distinct"
    return json.dumps(vectors, ensure_ascii=False, indent=2) + "\n"


def main():
    text = build()
    if sys.argv[1:] == ["--check"]:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.name} is out of date; run {pathlib.Path(__file__).name}", file=sys.stderr)
            sys.exit(1)
        return
    if sys.argv[1:]:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    OUT.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
