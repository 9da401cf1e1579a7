"""What crosses the ring's sockets: hellos, call headers and encoded values.

* **Hello** (magic ``TFDH``, ring token, rank, size, whether the sender
  holds a secret, a fresh nonce; 33 bytes): sent each way when neighbours
  connect, the acceptor's followed by a MAC, then the dialer's MAC
  (`tfdist._secret`). The ring token is the CRC-32 of the ring's
  key, so a connection from another ring, or from anything else, does not
  match and is dropped.
* **Header** (magic ``TFDC``, call number, length, wire dtype code, tag; 28
  bytes): the first bytes of every call. Each process checks its left
  neighbour's against its own, so processes that call in a different order
  fail loudly instead of adding unrelated numbers.
* **Values**: float32 buffers are sent as they are; with a 16-bit wire
  dtype each block is rounded into a wire buffer just before it is sent and
  widened back to float32 when it arrives.

Example::

  sent = header(call=0, length=1000, wire="bfloat16", tag=7)
  check_header(received, sent, source="socket transport, worker:0 (host)")
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

import ml_dtypes
import numpy as np

from tfdist.errors import ConfigError

__all__ = ["WIRE_DTYPES", "HELLO_SIZE", "HEADER_SIZE", "Hello", "ring_token",
           "hello", "parse_hello", "header", "check_header", "as_bytes",
           "encode", "decode"]

#: Wire dtype names and their numpy types.
WIRE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
_WIRE_CODES = {name: i for i, name in enumerate(WIRE_DTYPES)}

_HELLO = struct.Struct("!4sIIIB16s")  # magic, token, rank, size, signed, nonce
_HEADER = struct.Struct("!4sQQII")  # magic, call, length, wire code, tag
_MAGIC_HELLO = b"TFDH"
_MAGIC_CALL = b"TFDC"

#: Bytes of a hello and of a call header.
HELLO_SIZE = _HELLO.size
HEADER_SIZE = _HEADER.size


def ring_token(key: str) -> int:
  """The number a ring's hellos carry: the CRC-32 of its key."""
  return zlib.crc32(key.encode())


class Hello(NamedTuple):
  """A hello's fields."""
  token: int
  rank: int
  size: int
  signed: bool
  nonce: bytes


def hello(token: int, rank: int, size: int, *, nonce: bytes,
          signed: bool) -> bytes:
  """The hello of ``rank`` in a ring of ``size`` with ``token``.

  Args:
    token: the ring's `ring_token`.
    rank: the sender's rank.
    size: the ring's size.
    nonce: 16 fresh random bytes.
    signed: whether the sender holds a secret (so a peer can say why MACs
      differ).
  """
  return _HELLO.pack(_MAGIC_HELLO, token, rank, size, int(signed), nonce)


def parse_hello(data: bytes) -> Hello | None:
  """The fields of a hello, or ``None`` when ``data`` is not one."""
  if len(data) != HELLO_SIZE:
    return None
  magic, token, rank, size, signed, nonce = _HELLO.unpack(data)
  if magic != _MAGIC_HELLO or signed > 1:
    return None
  return Hello(token, rank, size, bool(signed), nonce)


def header(call: int, length: int, wire: str, tag: int) -> bytes:
  """The header of call number ``call``: ``length`` values as ``wire``.

  Args:
    call: the call's number, counted from 0 on each ring.
    length: float32 values the call moves.
    wire: a `WIRE_DTYPES` name.
    tag: the caller's number for the call site (its low 32 bits are sent).
  """
  return _HEADER.pack(_MAGIC_CALL, call, length, _WIRE_CODES[wire],
                      tag & 0xFFFFFFFF)


def _describe(fields: tuple) -> str:
  names = list(WIRE_DTYPES)
  code = fields[3]
  return (f"call #{fields[1]}, {fields[2]} values, wire "
          f"{names[code] if code < len(names) else code}, tag {fields[4]}")


def check_header(received: bytes | bytearray, sent: bytes, *,
                 source: str) -> None:
  """Checks the left neighbour's header against this process's own.

  Args:
    received: the header that arrived.
    sent: this process's header of the same call.
    source: the sender, for the error message.

  Raises:
    ConfigError: the headers differ (calls out of order); names both.
  """
  if received == sent:
    return
  theirs, mine = _HEADER.unpack(bytes(received)), _HEADER.unpack(sent)
  raise ConfigError(
      field="all-reduce order", value=_describe(theirs), source=source,
      expected=f"what this worker all-reduces: {_describe(mine)}",
      hint="Every worker must all-reduce the same gradients in the same "
           "order: build the same model and optimizer everywhere")


def as_bytes(array: np.ndarray) -> memoryview:
  """A flat byte view of a contiguous array (bfloat16 has no buffer code)."""
  return memoryview(array.view(np.uint8))


def encode(values: np.ndarray, into: np.ndarray) -> memoryview:
  """Rounds float32 ``values`` into the wire buffer ``into``; its bytes."""
  np.copyto(into, values, casting="unsafe")
  return as_bytes(into)


def decode(received: np.ndarray, into: np.ndarray) -> np.ndarray:
  """Widens wire values ``received`` into the float32 ``into``; ``into``."""
  np.copyto(into, received, casting="unsafe")
  return into
