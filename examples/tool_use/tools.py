"""The calculator tool of the tool-use example (TRL's tool form: type hints
and a docstring, from which the JSON schema is built)."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b
