"""The job's shared secret at work: nonces and role-labelled HMAC-SHA256.

Two places prove that a peer belongs to the job, the socket all-reduce ring
(`tfdist.ring.auth`) and the multi-node launch rendezvous
(`tfdist.launch.rendezvous`); both build their challenge and response from
these. The secret itself comes from `tfdist._net.job_secret`. Nothing here
imports TensorFlow or other tfdist modules.

Example::

  d, a = nonce(), nonce()
  proof = mac(secret, DIAL, "rendezvous", d, a)
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["ACCEPT", "DIAL", "VALUES", "MAC_SIZE", "NONCE_SIZE", "nonce",
           "mac"]

#: The role labels of `mac`: one side's proof never serves as the other's.
ACCEPT, DIAL, VALUES = b"accept", b"dial", b"values"
#: Bytes of a MAC (HMAC-SHA256) and of a nonce.
MAC_SIZE = hashlib.sha256().digest_size
NONCE_SIZE = 16


def nonce() -> bytes:
  """A fresh random nonce."""
  return secrets.token_bytes(NONCE_SIZE)


def mac(secret: bytes, role: bytes, key: str, *parts: bytes) -> bytes:
  """HMAC-SHA256 under ``secret`` of ``role``, a context ``key`` and ``parts``
  (each length-prefixed, so the concatenation is unambiguous)."""
  h = hmac.new(secret, role, hashlib.sha256)
  for part in (key.encode(), *parts):
    h.update(len(part).to_bytes(4, "big"))
    h.update(part)
  return h.digest()
