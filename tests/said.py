"""What a refused command says on stderr, read back: one paragraph (mpsimpact.errors.said), wrapped at the
terminal's width with its later lines indented under the message."""


def one_message(stderr: str, prefix: str = "error") -> str:
    """The message of a single `prefix: ...` paragraph, its lines joined with single spaces (as the message was
    before wrapping); fails on anything else (two messages, a traceback, an unindented line)."""
    lines = stderr.rstrip("\n").split("\n")
    indent = " " * (len(prefix) + 2)
    assert stderr.endswith("\n") and lines[0].startswith(f"{prefix}: "), stderr
    assert all(line.startswith(indent) and line.strip() for line in lines[1:]), stderr
    return " ".join(line.strip() for line in lines)


def messages(stderr: str) -> list[str]:
    """Each paragraph of stderr (a line that is not indented starts one), its lines joined with single spaces."""
    said: list[str] = []
    for line in stderr.splitlines():
        if said and line.startswith(" ") and line.strip():
            said[-1] += " " + line.strip()
        elif line.strip():
            said.append(line)
    return said


def flat(stderr: str) -> str:
    """stderr with each paragraph on one line (`messages`), for reading a phrase that a wrap may have cut."""
    return "\n".join(messages(stderr))
