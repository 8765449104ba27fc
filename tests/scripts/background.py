#!/usr/bin/env python3
"""Background traffic for the non-disturbance test: a TCP stream and non-RoCE UDP
datagrams with deterministic contents, sent at a bounded rate; the receivers check every
byte and print what they got as one JSON line. Standard library only.

  background.py tcp-recv ADDR PORT
  background.py tcp-send ADDR PORT BYTES RATE_BYTES_PER_S
  background.py udp-recv ADDR PORT COUNT IDLE_S
  background.py udp-send SRC ADDR PORT COUNT RATE_PPS
"""
import hashlib
import json
import socket
import struct
import sys
import time

UDP_LEN = 512


def pattern(offset, n):
    """Bytes [offset, offset+n) of the TCP stream: each 8-byte word is its own index."""
    first = offset // 8
    words = b"".join(struct.pack(">Q", i) for i in range(first, first + (n + 15) // 8 + 1))
    skip = offset - first * 8
    return words[skip:skip + n]


def datagram(seq):
    body = hashlib.sha256(struct.pack(">I", seq)).digest()
    return struct.pack(">I", seq) + (body * (UDP_LEN // len(body) + 1))[: UDP_LEN - 4]


def tcp_recv(addr, port):
    srv = socket.create_server((addr, port))
    print(json.dumps({"ready": True}), flush=True)
    conn, _ = srv.accept()
    h = hashlib.sha256()
    total = 0
    while True:
        b = conn.recv(1 << 16)
        if not b:
            break
        h.update(b)
        total += len(b)
    print(json.dumps({"bytes": total, "sha256": h.hexdigest()}), flush=True)


def tcp_send(addr, port, nbytes, rate):
    s = socket.create_connection((addr, port))
    h = hashlib.sha256()
    sent, chunk, t0 = 0, 1 << 14, time.monotonic()
    while sent < nbytes:
        b = pattern(sent, min(chunk, nbytes - sent))
        s.sendall(b)
        h.update(b)
        sent += len(b)
        ahead = sent / rate - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    print(json.dumps({"bytes": sent, "sha256": h.hexdigest()}), flush=True)


def udp_recv(addr, port, count, idle):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind((addr, port))
    s.settimeout(idle)
    print(json.dumps({"ready": True}), flush=True)
    seen, bad = set(), 0
    try:
        while len(seen) < count:
            b = s.recv(4096)
            seq = struct.unpack(">I", b[:4])[0]
            if b != datagram(seq):
                bad += 1
            seen.add(seq)
    except socket.timeout:
        pass
    print(json.dumps({"received": len(seen), "corrupt": bad}), flush=True)


def udp_send(src, addr, port, count, pps):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((src, 40000))
    t0 = time.monotonic()
    for seq in range(count):
        s.sendto(datagram(seq), (addr, port))
        ahead = (seq + 1) / pps - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    print(json.dumps({"sent": count}), flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "tcp-recv":
        tcp_recv(args[0], int(args[1]))
    elif mode == "tcp-send":
        tcp_send(args[0], int(args[1]), int(args[2]), float(args[3]))
    elif mode == "udp-recv":
        udp_recv(args[0], int(args[1]), int(args[2]), float(args[3]))
    elif mode == "udp-send":
        udp_send(args[0], args[1], int(args[2]), int(args[3]), float(args[4]))
    else:
        sys.exit(f"unknown mode {mode}")
