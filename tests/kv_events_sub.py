"""KV-cache event subscriber for tests/kv_events.rs: an independent decoder (pyzmq + msgpack,
and msgspec with structs shaped as vLLM's array-like KV events).

Usage: kv_events_sub.py tcp://HOST:PORT
Subscribes to every topic, says "subscribed" on stderr, reads the number N of messages to
wait for from stdin, then prints (stdout, JSON) the first N messages: frame count, topic (hex),
sequence number (8-byte big-endian), the msgpack-decoded payload, and whether msgspec decodes
the payload as a KV event batch and encodes it back to the same bytes. Exits 1 if N messages
do not arrive within 60 s of N being given.
"""

import json
import sys

import msgpack
import msgspec
import zmq


# The shape of vLLM's events before they became maps (array-like, tagged), as of the releases
# with lora_name. An array-like struct encodes every field, defaults included, so a
# byte-identical re-encoding shows the payload has exactly these fields in this order.
class Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(Batch)


def msgspec_roundtrip(payload):
    try:
        again = msgspec.msgpack.encode(DECODER.decode(payload))
        if again != payload:
            print(f"msgspec re-encodes {payload.hex()} as {again.hex()}", file=sys.stderr)
        return again == payload
    except msgspec.DecodeError as e:
        print(f"msgspec cannot decode a payload: {e}", file=sys.stderr)
        return False


def main():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(sys.argv[1])
    print("subscribed", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        print("no message count on stdin", file=sys.stderr)
        return 1
    want = int(line)
    out = []
    while len(out) < want:
        if not sock.poll(60_000):
            print(f"timed out after {len(out)} of {want} messages", file=sys.stderr)
            return 1
        frames = sock.recv_multipart()
        msg = {"frames": len(frames), "topic": frames[0].hex()}
        if len(frames) == 3:
            msg["seq_len"] = len(frames[1])
            msg["seq"] = int.from_bytes(frames[1], "big", signed=True)
            msg["payload"] = msgpack.unpackb(frames[2], raw=False)
            msg["msgspec_roundtrip"] = msgspec_roundtrip(frames[2])
        out.append(msg)
    # Anything more within a moment is reported too (there should be nothing).
    while sock.poll(300):
        frames = sock.recv_multipart()
        out.append({"frames": len(frames), "extra": True})
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
