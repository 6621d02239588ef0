"""KV-cache event subscriber for tests/kv_events.rs: an independent decoder (pyzmq + msgpack).

Usage: kv_events_sub.py tcp://HOST:PORT
Subscribes to every topic, says "subscribed" on stderr, reads the number N of messages to
wait for from stdin, then prints (stdout, JSON) the first N messages: frame count, topic (hex),
sequence number (8-byte big-endian) and the msgpack-decoded payload. Exits 1 if N messages do
not arrive within 60 s of N being given.
"""

import json
import sys

import msgpack
import zmq


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
        out.append(msg)
    # Anything more within a moment is reported too (there should be nothing).
    while sock.poll(300):
        frames = sock.recv_multipart()
        out.append({"frames": len(frames), "extra": True})
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
