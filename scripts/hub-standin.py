#!/usr/bin/env python3
"""A stand-in for the Hugging Face Hub on loopback, for scripts/hub-bench.sh: it serves one
repository holding one file (the file listing with its size and sha256, `resolve/REV/FILE` with
the Hub's metadata headers and ranges), or behaves as a hostile Hub would.

  scripts/hub-standin.py --port 8911 --repo org/M-GGUF --file models/SmolLM2-135M-Instruct.Q4_1.gguf
      [--listing-mb 20]   a listing of that many MB of nested arrays instead of the real one
      [--drip 2]          the file's body drips one byte every that many seconds

Prints `ready http://127.0.0.1:PORT` once it listens. The standard library only.
"""
import argparse
import hashlib
import http.server
import json
import os
import sys
import time

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--repo", default="org/M-GGUF")
    ap.add_argument("--file", required=True)
    ap.add_argument("--name", help="the file's name in the repository (default: org/M-GGUF's M-Q4_K_M.gguf)")
    ap.add_argument("--listing-mb", type=float, default=0)
    ap.add_argument("--drip", type=float, default=0)
    a = ap.parse_args()
    size = os.path.getsize(a.file)
    h = hashlib.sha256()
    with open(a.file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    sha = h.hexdigest()
    name = a.name or a.repo.split("/")[1].replace("-GGUF", "") + "-Q4_K_M.gguf"
    listing = json.dumps({"id": a.repo, "sha": COMMIT, "siblings": [
        {"rfilename": name, "size": size, "blobId": sha[:40], "lfs": {"sha256": sha, "size": size}}]}).encode()
    if a.listing_mb:
        parts = [b'{"sha": "%s", "siblings": [], "x": [' % COMMIT.encode()]
        n = int(a.listing_mb * 1e6) // 5
        parts.append(b"[[]]," * n)
        parts.append(b"[]]}")
        listing = b"".join(parts)

    class Hub(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def send_body(self, status, headers, body):
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            path = self.path.split("?")[0]
            if path == f"/api/models/{a.repo}/revision/main" or path == f"/api/models/{a.repo}":
                return self.send_body(200, {"Content-Type": "application/json"}, listing)
            prefix = f"/{a.repo}/resolve/"
            if not path.startswith(prefix) or not path.endswith("/" + name):
                return self.send_body(404, {}, b"not found")
            start, end = 0, size - 1
            rng = self.headers.get("Range", "")
            if rng.startswith("bytes="):
                lo, _, hi = rng[6:].partition("-")
                start = int(lo)
                end = min(int(hi), size - 1) if hi else size - 1
            meta = {"X-Repo-Commit": COMMIT, "X-Linked-Etag": f'"{sha}"', "ETag": f'"{sha}"',
                    "X-Linked-Size": size, "Accept-Ranges": "bytes",
                    "Content-Range": f"bytes {start}-{end}/{size}"}
            status = 206 if rng else 200
            if not a.drip:
                with open(a.file, "rb") as f:
                    f.seek(start)
                    return self.send_body(status, meta, f.read(end + 1 - start))
            self.send_response(status)
            for k, v in meta.items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(end + 1 - start))
            self.end_headers()
            if self.command == "HEAD":
                return
            with open(a.file, "rb") as f:
                f.seek(start)
                for _ in range(end + 1 - start):
                    try:
                        self.wfile.write(f.read(1))
                        self.wfile.flush()
                    except OSError:
                        return
                    time.sleep(a.drip)

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address):
            pass  # a client that hangs up (as a refused listing's does) is no news

    srv = Server(("127.0.0.1", a.port), Hub)
    print(f"ready http://127.0.0.1:{srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
