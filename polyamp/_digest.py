"""128-bit digests (BLAKE2b of the exact bytes) of what every rank must hold equal and no fingerprint
field holds as it is: a config, a guard's settings and histories, whose flag it is. Why 128 bits
(a 32-bit CRC collided): docs/distributed.md, "Every field is covered by the bound below".
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
