"""The body parser's child process (body_parser.py starts it as `python -I -S json_child.py MAX_VALUES`): reads
[8-byte length][JSON] from stdin, answers [8-byte length][one kind byte][payload] on stdout, until stdin closes.

Kinds: J a marshal of the parsed value; R nested too deeply; V not JSON Python reads (the payload is the message);
C more than MAX_VALUES values, lists and objects in all (0: no limit; the payload is how many were counted when
it stopped), which is sent back without them. It imports nothing of lorad's, so it starts in milliseconds and
never holds the daemon's interpreter lock.
"""

import json
import marshal
import signal
import struct
import sys

HEADER = struct.Struct("<Q")


def count_values(value, limit: int) -> int:
    """The values in `value` (itself, and every item and object value in it), counting stopped past `limit`."""
    count, stack = 0, [value]
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            containers = [inner for inner in item if isinstance(inner, (list, dict))]
            count += len(item) - len(containers)
            stack += containers
    return count


def answer(raw: bytes, max_values: int) -> bytes:
    try:
        value = json.loads(raw)
    except RecursionError:
        return b"R"
    except ValueError as error:  # not JSON, not UTF-8, or an integer of too many digits
        return b"V" + str(error)[:200].encode()
    if max_values:
        count = count_values(value, max_values)
        if count > max_values:
            return b"C" + str(count).encode()
    try:
        return b"J" + marshal.dumps(value)
    except ValueError as error:  # too deep to marshal (json's own limit comes first)
        return b"V" + str(error)[:200].encode()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the daemon's to handle; stdin's end stops us
    max_values = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while header := stdin.read(HEADER.size):
        raw = stdin.read(HEADER.unpack(header)[0])
        reply = answer(raw, max_values)
        stdout.write(HEADER.pack(len(reply)))
        stdout.write(reply)
        stdout.flush()


if __name__ == "__main__":
    main()
