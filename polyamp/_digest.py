"""128-bit digests of what every rank must hold equal and no fingerprint field holds as it is (a
config, a guard's settings and histories, whose flag it is): BLAKE2b of the exact bytes.

They enter the rank fingerprint as four 32-bit words each, every 16-bit half with a weight of its
own, as the scale's bits do (:mod:`polyamp.distributed._fingerprint`): two different contents share
a digest with probability 2**-128 (a 32-bit CRC shared one with 2**-32, and a colliding pair was
found in a second), far below the agreement's documented 2**-41 per step.
"""

from __future__ import annotations

import hashlib

#: Bits of a content digest.
BITS = 128


def content_digest(*parts: bytes) -> int:
    """A non-zero ``BITS``-bit digest of ``parts`` (each length-prefixed, so no two splits of the
    same bytes collide)."""
    hasher = hashlib.blake2b(digest_size=BITS // 8, person=b"polyamp ranks")
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return int.from_bytes(hasher.digest(), "little") or 1


def to_bytes(digest: int) -> bytes:
    """A digest (or any int below 2**BITS) as ``BITS // 8`` bytes, to fold into another."""
    return digest.to_bytes(BITS // 8, "little")
