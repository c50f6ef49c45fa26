"""The body parser's child process (body_parser.py starts it as `python -I -S json_child.py`): reads
[8-byte length][JSON] from stdin, answers [8-byte length][one kind byte][payload] on stdout, until stdin closes.

Kinds: J a marshal of the parsed value; R nested too deeply; V not JSON Python reads (the payload is the message).
It imports nothing of lorad's, so it starts in milliseconds and never holds the daemon's interpreter lock.
"""

import json
import marshal
import signal
import struct
import sys

HEADER = struct.Struct("<Q")


def answer(raw: bytes) -> bytes:
    try:
        return b"J" + marshal.dumps(json.loads(raw))
    except RecursionError:
        return b"R"
    except ValueError as error:  # not JSON, not UTF-8, an integer of too many digits, or too deep to marshal
        return b"V" + str(error)[:200].encode()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the daemon's to handle; stdin's end stops us
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while header := stdin.read(HEADER.size):
        raw = stdin.read(HEADER.unpack(header)[0])
        reply = answer(raw)
        stdout.write(HEADER.pack(len(reply)))
        stdout.write(reply)
        stdout.flush()


if __name__ == "__main__":
    main()
