"""What crosses from a replica to the ingress besides chunks: answers and errors.

A :class:`~penstock.errors.PenstockError` does not keep its status, param and code
across processes, so a replica sends it encoded (:func:`encode_error`) and the ingress
raises it again (:func:`decode_error`) with the same class, status, param and code:

* in a stream, as the last entry of a chunk batch (:func:`error_entry`), as in a LoRA
  adapter load's answer;
* in a fleet admin call, each replica's answer is :func:`ok_answer` (its name, ``ok``
  and the operation's fields) or :func:`failed_answer` (its name and the encoded error).

and the frames of the data plane (:class:`FrameProtocol`): the streams between a replica
and the ingress over one connection.

Both ends import this module and nothing else of each other.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
from collections.abc import Callable
from typing import Any, cast

import msgspec

from penstock import errors
from penstock.errors import PayloadTooLargeError, PenstockError

logger = logging.getLogger(__name__)

# Pausing in place freezes in-flight requests and holds new ones: nothing is lost. The
# ingress asks it of every replica a weight update begins on; a replica replaying the
# fleet's last update on itself pauses the same way.
TRANSACTION_PAUSE_MODE = "keep"


def encode_error(error: PenstockError) -> dict[str, Any]:
    return {
        "class": type(error).__name__,
        "status": error.status_code,
        "message": error.message,
        "param": error.param,
        "code": error.code,
    }


def decode_error(encoded: dict[str, Any]) -> PenstockError:
    """The :class:`PenstockError` a replica reported, with its status, code and param."""
    cls = getattr(errors, str(encoded.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, PenstockError)):
        cls = PenstockError
    message, code = str(encoded.get("message")), encoded.get("code")
    try:
        error = cls(message, param=encoded.get("param"), code=code)
    except TypeError:
        error = PenstockError(message, code=code)
    error.status_code = int(encoded.get("status") or 500)
    return error


def error_entry(error: PenstockError) -> dict[str, Any]:
    """A stream's last batch entry, or an adapter load's answer, carrying ``error``."""
    return {"error": encode_error(error)}


def entry_error(entry: dict[str, Any]) -> PenstockError | None:
    """The error an :func:`error_entry` carries; ``None`` for any other entry (a chunk)."""
    if len(entry) == 1 and "error" in entry:
        return decode_error(entry["error"])
    return None


def ok_answer(replica: str, **fields: Any) -> dict[str, Any]:
    return {"replica": replica, "ok": True, **fields}


def failed_answer(replica: str, error: PenstockError) -> dict[str, Any]:
    return {"replica": replica, "ok": False, "error": encode_error(error)}


def answer_error(answer: dict[str, Any]) -> PenstockError:
    """The error of a :func:`failed_answer`."""
    return decode_error(answer["error"])


# The data plane: one TCP connection from the ingress to each replica carries every
# stream between them, as MessagePack arrays, each behind its length (4 bytes, big-endian).
# Ingress to replica: HELLO first (the fleet's token), then OPEN, CANCEL and CREDIT (stream
# ids and their credit, flat: ``[CREDIT, [id, credit, id, credit, ...]]``). Replica to
# ingress: BATCH, at most one per FRAME_INTERVAL_S (``penstock.ray.batching``), with every
# stream's chunks since the last one (an error entry last when the stream failed) and the
# streams that ended:
# ``[BATCH, [id, chunks, id, chunks, ...], [ended id, ...]]``. A replica sends a stream at
# most WINDOW batches beyond what the ingress has consumed; the ingress returns credit
# every WINDOW // 2 batches it consumed.
HELLO, OPEN, CANCEL, CREDIT, BATCH = "hello", "open", "cancel", "credit", "batch"
WINDOW = 32
# The key of a replica's status answer holding its data plane address (``host:port``).
ADDRESS_KEY = "data_address"
# A value MessagePack has no type for (a tensor, an image) crosses pickled, as through
# Ray; a replica unpickles only once the connection has shown the fleet's token.
_PICKLED = 1
_LENGTH = 4
# The longest frame either end accepts: a request with its decoded media, or a batch of
# chunks, stays far below it. A peer declaring more is closed on before its body is read.
MAX_FRAME_BYTES = 1 << 30
# The longest frame of a peer not yet known to be of this fleet: its HELLO, the token.
MAX_UNTRUSTED_FRAME_BYTES = 4096


def _pickled(value: Any) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(_PICKLED, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_pickled)


class FrameProtocol(asyncio.Protocol):
    """One end of a data plane connection: frames in to ``on_frame``, out by :meth:`send`.

    ``trusted``: whether pickled values from the peer are unpickled from the start (the
    ingress, which connected to the address Ray gave it); else once :meth:`trust` is called.
    Until then a frame is at most ``MAX_UNTRUSTED_FRAME_BYTES``, after it
    ``MAX_FRAME_BYTES``: a peer declaring a longer one is closed on, nothing of its body
    kept.
    ``on_writable``: called when the socket's send buffer, full before, drains.
    """

    def __init__(
        self,
        on_frame: Callable[[list[Any]], None],
        on_lost: Callable[[Exception | None], None],
        *,
        trusted: bool,
        on_writable: Callable[[], None] | None = None,
    ) -> None:
        self._on_frame = on_frame
        self._on_writable = on_writable
        self._on_lost = on_lost
        self._trusted = trusted
        self._decoder = msgspec.msgpack.Decoder(ext_hook=self._unpickled)
        self._received = bytearray()
        self._transport: asyncio.Transport | None = None
        self._pending: list[bytes] = []
        self._writable = True

    def trust(self) -> None:
        self._trusted = True

    def _unpickled(self, code: int, data: memoryview) -> Any:
        if code != _PICKLED or not self._trusted:
            raise ValueError("a pickled value from a peer not known to be of this fleet")
        return pickle.loads(data)

    @property
    def closed(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (asyncio's or uvloop's, which does not subclass asyncio's).
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    def data_received(self, data: bytes) -> None:
        received = self._received
        received += data
        start, end = 0, len(received)
        # The view is released before the buffer is cut, whatever a frame raised.
        with memoryview(received) as view:
            try:
                while end - start >= _LENGTH and not self.closed:
                    size = int.from_bytes(view[start : start + _LENGTH], "big")
                    if size > self._frame_limit:
                        raise ValueError(f"a frame of {size} bytes declared")
                    if end - start - _LENGTH < size:
                        break
                    start += _LENGTH
                    frame = self._decoder.decode(view[start : start + size])
                    start += size
                    self._on_frame(frame)
            except (ValueError, msgspec.DecodeError) as exc:
                logger.warning("closing a data plane connection: %s", exc)
                self.close()
        if self.closed:
            received.clear()
        else:
            del received[:start]

    @property
    def _frame_limit(self) -> int:
        return MAX_FRAME_BYTES if self._trusted else MAX_UNTRUSTED_FRAME_BYTES

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        if self._on_writable is not None:
            self._on_writable()

    @property
    def writable(self) -> bool:
        return self._writable

    def send(self, *frame: Any) -> None:
        """Queue ``frame``; the frames of one turn of the event loop leave in one write."""
        if self.closed:
            return
        body = _ENCODER.encode(frame)
        _check_length(len(body))
        self._pending.append(len(body).to_bytes(_LENGTH, "big") + body)
        if len(self._pending) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def send_now(self, *frame: Any) -> None:
        """Write ``frame`` at once (for a caller that gathers its frames itself); an
        error encoding it is raised before anything is written."""
        buffer = bytearray(_LENGTH)
        _ENCODER.encode_into(frame, buffer, _LENGTH)
        _check_length(len(buffer) - _LENGTH)
        buffer[:_LENGTH] = (len(buffer) - _LENGTH).to_bytes(_LENGTH, "big")
        if not self.closed:
            assert self._transport is not None
            self._transport.write(buffer)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not self.closed:
            assert self._transport is not None
            self._transport.write(b"".join(pending))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _check_length(size: int) -> None:
    if size > MAX_FRAME_BYTES:
        raise PayloadTooLargeError(
            f"a data plane frame of {size} bytes is over the limit of {MAX_FRAME_BYTES}"
        )
