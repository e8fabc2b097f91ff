"""The tool-use example's rewards, in TRL's form: ``completions`` are the
trajectory's messages after the prompt (assistant and tool turns)."""

import re


def _numbers(text: str) -> list[str]:
    return [n.replace(",", "") for n in re.findall(r"-?\d[\d,]*", text)]


def correct(completions, answer, **kwargs) -> list[float]:
    """1.0 where the last assistant message's last number is the answer."""
    out = []
    for messages, want in zip(completions, answer):
        said = [m["content"] for m in messages if m["role"] == "assistant"]
        numbers = _numbers(said[-1]) if said else []
        out.append(float(bool(numbers) and numbers[-1] == want))
    return out


def called_tool(completions, **kwargs) -> list[float]:
    """1.0 where the trajectory holds a tool result that is not an error."""
    return [float(any(m["role"] == "tool" and '"error"' not in m["content"] for m in messages))
            for messages in completions]
