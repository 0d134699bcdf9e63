import socket
from types import SimpleNamespace

import pytest


@pytest.fixture
def squatted_port(monkeypatch):
    """A port another socket holds, and `trainers.backends.free_port` patched to hand it out first (then real free
    ports): what a launcher sees when another process binds its port between `free_port` and the rendezvous.
    `.handed` lists the ports handed out; `.always()` makes every call return the taken port."""
    import trainers.backends as tb

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    s = SimpleNamespace(taken=squatter.getsockname()[1], handed=[])
    real = tb.free_port

    def first_taken():
        s.handed.append(s.taken if not s.handed else real())
        return s.handed[-1]

    s.always = lambda: monkeypatch.setattr(tb, "free_port", lambda: s.taken)
    monkeypatch.setattr(tb, "free_port", first_taken)
    yield s
    squatter.close()
