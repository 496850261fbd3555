"""A WebSocket echo server on port 8765 in the standard library alone (the test's service: hot reload's kind of
traffic), answering each text message with "echo: " before it."""

import base64
import hashlib
import socketserver
import struct

MAGIC = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Echo(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        headers = {}
        self.rfile.readline()
        while line := self.rfile.readline().decode().strip():
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        accept = base64.b64encode(hashlib.sha1((headers["sec-websocket-key"] + MAGIC).encode()).digest()).decode()
        self.wfile.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            + f"Sec-WebSocket-Accept: {accept}\r\n\r\n".encode()
        )
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            opcode, length = head[0] & 0x0F, head[1] & 0x7F
            if length == 126:
                (length,) = struct.unpack(">H", self.rfile.read(2))
            elif length == 127:
                (length,) = struct.unpack(">Q", self.rfile.read(8))
            mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
            if opcode == 8:
                self.wfile.write(b"\x88\x00")
                return
            if opcode == 1:
                reply = b"echo: " + data
                size = bytes([len(reply)]) if len(reply) < 126 else b"\x7e" + struct.pack(">H", len(reply))
                self.wfile.write(b"\x81" + size + reply)


socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("", 8765), Echo).serve_forever()
