"""`python -m tests.support.server_holding_tokenization ARGS` (from the repository's root): the real server
(`service.cli.main`: its signals, drain and exit status) whose tokenizer holds a request whose
first input starts with "hold" until the test lets it go, so a test can place a signal while a
received request is still being tokenized, whatever the speed of this machine. The tokenizer
connects to 127.0.0.1:$HOLD_PORT, says `tokenizing`, and goes on once it reads `go`."""

from __future__ import annotations

import os
import socket

from service.cli import main
from service.tokenization import TextTokenizer

encode = TextTokenizer.encode


def held_encode(self, inputs, *args):
    if inputs and isinstance(inputs[0], str) and inputs[0].startswith("hold"):
        with socket.create_connection(("127.0.0.1", int(os.environ["HOLD_PORT"])), timeout=120) as test:
            test.sendall(b"tokenizing")
            assert test.recv(2) == b"go"
    return encode(self, inputs, *args)


TextTokenizer.encode = held_encode

if __name__ == "__main__":
    raise SystemExit(main())
