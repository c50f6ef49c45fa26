"""Stand-ins for the scheduler's memory and adapters protocols (scheduler/batching.py) and a settable
clock, shared by the scheduler tests."""


class Memory:
    def grow(self, blocks, num_tokens):
        blocks[:] = [0] * num_tokens
        return True

    def release(self, blocks):
        blocks.clear()


class Adapters:
    def acquire(self, name, tokens=None):
        return True

    def release(self, name):
        pass

    def staging(self, name):
        return False


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now
