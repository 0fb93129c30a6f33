"""Test helpers that hold a server's work back."""


def hold_compiles(cache, gate):
    """Compiles that start from now on wait for ``gate`` (as if every compile thread were busy);
    once it is set they run as usual."""
    original = cache._compile

    def held(entry):
        gate.wait()
        original(entry)

    cache._compile = held
