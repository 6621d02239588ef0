"""KV-cache event subscriber for tests/kv_events.rs: an independent decoder (pyzmq + msgpack,
and msgspec with structs shaped as vLLM's array-like KV events).

Usage: kv_events_sub.py tcp://HOST:PORT [--bind] [--topic PREFIX]
Connects to the publisher (with --bind: binds there and waits for the publisher to connect, as
llm-d's endpoint picker does), subscribes to PREFIX (default: every topic), says "subscribed"
on stderr, reads the number N of messages to
wait for from stdin, then prints (stdout, JSON) the first N messages: frame count, topic (hex),
sequence number (8-byte big-endian), the msgpack-decoded payload, and whether msgspec decodes
the payload as a KV event batch and encodes it back to the same bytes. Exits 1 if N messages
do not arrive within 60 s of N being given.
"""

import json
import select
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
    args = sys.argv[1:]
    topic = args[args.index("--topic") + 1].encode() if "--topic" in args else b""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.setsockopt(zmq.RCVHWM, 0)
    if "--bind" in args:
        sock.bind(args[0])
    else:
        sock.connect(args[0])
    print("subscribed", file=sys.stderr, flush=True)
    # Keep the socket's command queue served while waiting for the count: a bound SUB socket
    # attaches a connecting publisher (and sends it the subscription) only when its owner
    # thread calls into libzmq.
    while not select.select([sys.stdin], [], [], 0.05)[0]:
        sock.getsockopt(zmq.EVENTS)
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
