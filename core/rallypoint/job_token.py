"""The keys a job's token (``--rdzv-conf token_file``, ``RALLYPOINT_JOB_TOKEN``) gives.

Every use of the token gets a key of its own (``derive``): the seals of the rendezvous
records and the proofs of the checkpoint transfers can never pass for each other. The
derivation is scrypt, a memory-hard function: a token that an attacker can try offline
(from a recorded transfer or a sealed record) costs him about 40 ms and 16 MiB per guess
rather than one HMAC. It costs an agent the same once per purpose, at start.
"""

from __future__ import annotations

import functools
import hashlib

#: The scrypt parameters: 2**14 rounds of 8 blocks, 16 MiB, about 40 ms on a server core.
_N, _R, _P = 1 << 14, 8, 1


@functools.lru_cache(maxsize=8)
def derive(token: bytes, purpose: str) -> bytes:
    """The 32-byte key of ``token`` for ``purpose`` ("rendezvous records", "peer
    transfers"); computed once per process."""
    salt = b"rallypoint\0" + purpose.encode()
    return hashlib.scrypt(token, salt=salt, n=_N, r=_R, p=_P, maxmem=64 << 20, dklen=32)
