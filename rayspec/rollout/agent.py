"""Multi-turn rollouts with tools and environments, in TRL's form.

A trajectory is one coroutine of requests on the replica's ``AsyncLLM``
(``AsyncEngine.generate_one``): the model writes a turn, vLLM's tool parser
(``rollout.tool_parser``, e.g. ``hermes`` for Qwen-style ``<tool_call>``
JSON) reads its calls, the tools run (in threads, each bounded by
``rollout.tool_timeout_s``), the chat template renders their results as
``tool`` messages, and the next turn is generated on the whole sequence so
far, up to ``rollout.max_turns`` turns and ``grpo.max_new_tokens`` tokens
after the prompt. The model's tokens are kept as generated and the tool
messages' tokens appended after them, so the trainer sees exactly the
sequence the replica sampled (no re-tokenization between turns); the tool
tokens are masked out of the loss (``RolloutBatch.loss_mask``).

What follows TRL (``GRPOTrainer(tools=..., environment_factory=...)``,
trl 1.16): a tool is a Python function with type hints and a docstring, its
schema from ``transformers.utils.get_json_schema``; an environment is a
class, one instance per trajectory, ``reset(**row)`` before the first turn
(a string it returns is appended to the last user message), its public
methods its tools, an optional ``get_reward()`` a reward of its own; a tool
result is ``str(result)`` in a ``tool`` message; reward functions get the
trajectory's messages as ``completions`` and the instances as
``environments``; the tool tokens are cut at the EOS-trimmed prefix of a
dummy conversation (``GRPOTrainer._get_tool_suffix_ids``).

Where rayspec differs, and why:
- The environment class is named in the config (``file.py:Class``) and
  built with no arguments, where TRL takes a factory callable: a config
  names classes, not closures. It runs in the rollout replica's process,
  beside the engine, so a trajectory's turns never leave the replica.
- The calls are parsed with vLLM's tool parsers (the server's own), not
  transformers' response schemas, which few tokenizers ship.
- A template without tool support (SmolLM2's) gets the tools and the
  Hermes call format in its system prompt (``TEXT_FORMAT``), where TRL
  refuses the model; a template that cannot render a ``tool`` message is
  refused, as TRL refuses it.
- A malformed call, an unknown tool, a tool that raises or outruns
  ``rollout.tool_timeout_s`` gets a tool message saying so (JSON
  ``{"error": ...}``), counted in the record, and the trajectory goes on
  (TRL counts failures; it has no timeout).
- A tool result is cut to ``rollout.max_tool_response_tokens`` tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import logging
from typing import Any, Awaitable, Callable, Optional

from rayspec.batch import mask_runs
from rayspec.files import import_object
from rayspec.rollout.spec_stats import completion_stats, sampled_logprobs, weight_spans

log = logging.getLogger(__name__)

# the Hermes function-calling format (NousResearch's Hermes 2 Pro, the format Qwen2.5's template writes), for a
# chat template that renders no tools of its own; vLLM's ``hermes`` parser reads it
TEXT_FORMAT = """You can call functions. Their signatures, as JSON schemas:
<tools>
{tools}
</tools>
To call one, write a JSON object with the function's name and arguments between tags, e.g.
<tool_call>
{{"name": "<function name>", "arguments": {{"<argument>": <value>}}}}
</tool_call>
Its result comes back in a message from the tool. Answer the user once you have what you need."""
TRUNCATED = " ... [truncated]"


class ToolError(ValueError):
    """A tool, an environment or a chat template that cannot serve
    multi-turn rollouts; the message names the config key and the fix."""


@dataclasses.dataclass
class Toolset:
    """The tools of ``rollout.tools`` and the class of ``rollout.environment``.

    Attributes:
        functions: the standalone tools (one set for every trajectory).
        environment: the environment class (one instance per trajectory), or None.
        schemas: every tool's JSON schema (OpenAI's ``{"type": "function",
            "function": {...}}``, from ``transformers.utils.get_json_schema``),
            the functions' then the environment's methods'.
    """

    functions: list[Callable]
    environment: Optional[type]
    schemas: list[dict]

    @classmethod
    def load(cls, tools: list[str], environment: Optional[str]) -> "Toolset":
        """Import the tools and the environment class, check them, and build their schemas.

        Raises:
            ToolError: naming ``rollout.tools[i]`` / ``rollout.environment``:
                not importable, not a function / class, no type hints or
                docstring (``transformers.utils.get_json_schema``'s message),
                an environment without a callable ``reset``, or two tools of
                one name.
        """
        from transformers.utils import get_json_schema

        functions = []
        for i, spec in enumerate(tools):
            fn = import_object(spec, f"rollout.tools[{i}]={spec}", ToolError)
            if not inspect.isfunction(fn):
                raise ToolError(f"rollout.tools[{i}]={spec}: a {type(fn).__name__}, not a function")
            functions.append((f"rollout.tools[{i}]={spec}", fn))
        env_cls = None
        if environment is not None:
            env_cls = import_object(environment, f"rollout.environment={environment}", ToolError)
            if not inspect.isclass(env_cls):
                raise ToolError(f"rollout.environment={environment}: a {type(env_cls).__name__}, not a class "
                                "(one instance is built per trajectory, with no arguments)")
            if not callable(getattr(env_cls, "reset", None)):
                raise ToolError(f"rollout.environment={environment}: {env_cls.__name__} has no reset method: "
                                "define reset(self, **row) (it may return a string appended to the prompt)")
            # the methods bound to a bare instance (no __init__ run): their schemas without ``self``
            functions += [(f"rollout.environment={environment}: method {m.__name__}", m)
                          for m in _methods(object.__new__(env_cls))]
        schemas, names = [], set()
        for key, fn in functions:
            try:
                schemas.append(get_json_schema(fn))
            except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
                raise ToolError(f"{key}: no JSON schema for it ({e}): a tool needs type hints on every argument "
                                "and a docstring with an Args section, as TRL's tools do") from None
            if fn.__name__ in names:
                raise ToolError(f"{key}: a second tool named {fn.__name__!r}")
            names.add(fn.__name__)
        return cls([fn for _, fn in functions[:len(tools)]], env_cls, schemas)

    def reward_name(self) -> Optional[str]:
        """The environment class's name where it defines ``get_reward`` (a
        reward source of its own, TRL's rule), else None."""
        has = self.environment is not None and callable(getattr(self.environment, "get_reward", None))
        return self.environment.__name__ if has else None

    def callables(self, env) -> dict[str, Callable]:
        """{tool name: function} for a trajectory with environment ``env`` (or None)."""
        return {fn.__name__: fn for fn in self.functions + (_methods(env) if env is not None else [])}


def _methods(env) -> list[Callable]:
    """An environment instance's tools: its public methods other than
    ``reset`` and ``get_reward`` (TRL's rule), bound."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")]


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template writes the ``tools`` it is given into the
    prompt (else rayspec writes them into the system prompt, ``TEXT_FORMAT``)."""
    probe = {"type": "function", "function": {"name": "rayspec_probe_tool_5c1e", "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that raises on tools has no support for them
        return False
    return "rayspec_probe_tool_5c1e" in text


def check_template(tokenizer, model: str) -> None:
    """Refuse a chat template that cannot render a ``tool`` message (drops
    its content or raises), as TRL's ``supports_tool_calling`` does.

    Raises:
        ToolError: naming the model and the fix.
    """
    content = "rayspec_tool_content_9a2f"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "call"},
                {"role": "tool", "name": "f", "content": content}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ok, why = content in text, "drops the tool message's content"
    except Exception as e:
        ok, why = False, f"raises on it ({type(e).__name__}: {e})"
    if not ok:
        raise ToolError(f"model.path={model}: its chat template cannot render a tool message ({why}); "
                        "rollout.tools and rollout.environment need one that can (set a tokenizer chat_template "
                        "that renders role 'tool', e.g. ChatML's)")


def agent_messages(messages: list[dict], schemas: list[dict], native: bool) -> list[dict]:
    """The prompt's messages with the tools described where the template
    does not render them (``TEXT_FORMAT`` in the system message, which is
    added where there is none)."""
    if native or not schemas:
        return list(messages)
    tools = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    text = TEXT_FORMAT.format(tools=tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}] + list(messages[1:])
    return [{"role": "system", "content": text}] + list(messages)


def agent_prompt_ids(tokenizer, messages: list[dict], schemas: list[dict], native: bool) -> list[int]:
    """Token ids of a tool-using prompt: the chat template with the tools
    (``tools=`` where it renders them, else ``agent_messages``' system
    prompt) and the assistant turn opened."""
    kwargs = {"tools": schemas} if native and schemas else {}
    return list(tokenizer.apply_chat_template(agent_messages(messages, schemas, native), add_generation_prompt=True,
                                              tokenize=True, return_dict=True, **kwargs)["input_ids"])


def tool_suffix_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The tokens that follow a model turn ending in EOS: the ``tool``
    messages as the template renders them, then the next assistant turn
    opened. Cut as TRL cuts them: a dummy conversation rendered without and
    with the messages, the first trimmed after its last EOS (ChatML's
    ``<|im_end|>`` then ``\\n``: the newline is the suffix's, the model
    wrote only the EOS).

    Raises:
        ToolError: the trimmed prefix is not a prefix of the whole (a template
            that renders earlier messages differently once a tool message follows).
    """
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]}]

    def ids(msgs, gen):
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True,
                                                  return_dict=True)["input_ids"])

    prefix, full = ids(dummy, False), ids(dummy + tool_messages, True)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[:eos[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ToolError("the chat template renders a conversation differently once a tool message follows: "
                        "the tool message's tokens cannot be appended after the model's")
    return full[len(prefix):]


class ToolCallParser:
    """vLLM's tool parser ``name`` over a turn's text.

    Args:
        name: a registered vLLM tool parser (``vllm.tool_parsers.ToolParserManager``).
        tokenizer: the policy's (HF) tokenizer.
        schemas: the tools' JSON schemas (``Toolset.schemas``).

    Raises:
        ToolError: no such parser (naming the registered ones).
    """

    def __init__(self, name: str, tokenizer, schemas: list[dict]):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            parser_cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ToolError(f"rollout.tool_parser={name!r}: not one of vLLM's tool parsers "
                            f"({', '.join(sorted(ToolParserManager.list_registered()))})") from None
        # a malformed call is the policy's mistake, told to it and counted (``parse``); the parser logs a
        # traceback for each, which at a 135M policy's rate buries the replica's log
        logging.getLogger(parser_cls.__module__).setLevel(logging.CRITICAL)
        self._request = ChatCompletionRequest(model="rayspec", messages=[{"role": "user", "content": ""}],
                                              tools=schemas or None)
        self._parser = parser_cls(tokenizer, self._request.tools)
        self._start = getattr(parser_cls, "tool_call_start_token", None)

    def parse(self, text: str) -> tuple[list[tuple[str, Any]], Optional[str]]:
        """(calls [(name, arguments)], why the text's calls are malformed or None)."""
        got = self._parser.extract_tool_calls(text, self._request)
        if not got.tools_called:
            if self._start and self._start in text:
                return [], f"could not parse the tool call: expected {self._start}" + \
                    '{"name": ..., "arguments": {...}}' + "; write valid JSON"
            return [], None
        calls = []
        for call in got.tool_calls:
            try:
                args = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as e:
                return [], f"the arguments of {call.function.name!r} are not JSON ({e})"
            calls.append((call.function.name, args))
        return calls, None


@dataclasses.dataclass
class Trajectory:
    """One multi-turn sample, as the trainer sees it.

    Attributes:
        response_ids: every token after the prompt (model turns and tool
            messages, in order).
        logprobs: per token of ``response_ids``, the rollout logprob (0.0 on tool tokens).
        loss_mask: per token, 1 where the model sampled it, 0 where a tool message put it.
        messages: the assistant and tool messages after the prompt (TRL's
            conversational ``completions``).
        weight_versions: [(version, start, end)] of the model's tokens, as
            ``RolloutBatch.weight_versions`` (offsets into ``response_ids``).
        counts: turns, tool_calls, tool_errors (raised, timed out, unknown
            tool), tool_timeouts, malformed_calls.
        outputs: vLLM's ``RequestOutput`` of each turn (its spec-decode metrics).
        environment: the trajectory's environment instance, or None.
    """

    response_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    messages: list[dict] = dataclasses.field(default_factory=list)
    weight_versions: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    counts: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(
        ("turns", "tool_calls", "tool_errors", "tool_timeouts", "malformed_calls"), 0))
    outputs: list = dataclasses.field(default_factory=list)
    environment: Any = None

    def add(self, ids: list[int], logprobs: list[float], model: bool) -> None:
        self.response_ids += ids
        self.logprobs += logprobs if model else [0.0] * len(ids)
        self.loss_mask += [int(model)] * len(ids)


class AgentRunner:
    """Runs trajectories on one replica: the toolset, the chat template's
    rendering and the tool parser, built once.

    Args:
        toolset: ``Toolset.load``'s.
        tokenizer: the policy's HF tokenizer.
        tool_parser: vLLM's parser name (``rollout.tool_parser``).
        max_turns: model turns per trajectory at most.
        max_tool_response_tokens: a tool message's content is cut to this many tokens.
        tool_timeout_s: seconds a tool call may take (then reported to the model).
        max_tool_threads: tool calls running at once (threads; one that
            outruns its timeout keeps its thread until it returns).
    """

    def __init__(self, toolset: Toolset, tokenizer, tool_parser: str = "hermes", max_turns: int = 4,
                 max_tool_response_tokens: int = 256, tool_timeout_s: float = 10.0, max_tool_threads: int = 32):
        self.toolset, self.tokenizer = toolset, tokenizer
        self.native = template_renders_tools(tokenizer)
        self.schemas = toolset.schemas
        self.parser = ToolCallParser(tool_parser, tokenizer, self.schemas)
        self.max_turns, self.max_tool_response_tokens = max_turns, max_tool_response_tokens
        self.tool_timeout_s = tool_timeout_s
        self._threads = concurrent.futures.ThreadPoolExecutor(max_tool_threads, thread_name_prefix="rayspec-tool")

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return agent_prompt_ids(self.tokenizer, messages, self.schemas, self.native)

    async def run(self, generate: Callable[[list[int], int], Awaitable[Any]], prompt_ids: list[int],
                  row: dict[str, Any], max_new_tokens: int,
                  share: Optional[Callable[[list[int]], Awaitable[None]]] = None) -> Trajectory:
        """One trajectory from ``prompt_ids`` (``prompt_ids(row["prompt"])``).

        Args:
            generate: ``await generate(token_ids, max_tokens)`` -> vLLM's
                final ``RequestOutput`` of one sample of that prompt.
            row: the dataset row: ``prompt`` (messages) and its columns,
                passed to the environment's ``reset``.
            max_new_tokens: tokens after the prompt at most (model and tool).
            share: awaited with each tool message's tokens once they join the
                trajectory (the group-suffix drafter indexes them for the
                other trajectories on the replica), or None.
        """
        traj = Trajectory()
        if self.toolset.environment is not None:
            traj.environment = self.toolset.environment()
            observation = await self._call(traj.environment.reset, row)
            if isinstance(observation, str):  # TRL: appended to the last user message
                messages = list(row["prompt"])
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
                prompt_ids = self.prompt_ids(messages)
        tools = self.toolset.callables(traj.environment)
        eos = self.tokenizer.eos_token_id
        while traj.counts["turns"] < self.max_turns and len(traj.response_ids) < max_new_tokens:
            out = await generate(prompt_ids + traj.response_ids, max_new_tokens - len(traj.response_ids))
            traj.outputs.append(out)
            c = out.outputs[0]
            start = len(traj.response_ids)
            traj.add(list(c.token_ids), sampled_logprobs(c), model=True)
            traj.weight_versions += weight_spans(c, start)
            traj.counts["turns"] += 1
            ids = list(c.token_ids)
            text = self.tokenizer.decode(ids[:-1] if ids and ids[-1] == eos else ids, skip_special_tokens=False)
            traj.messages.append({"role": "assistant", "content": text})
            # a turn cut by max_tokens, or ended by something other than EOS, is the trajectory's end
            if not ids or ids[-1] != eos or traj.counts["turns"] == self.max_turns:
                break
            calls, malformed = self.parser.parse(text)
            if not calls and malformed is None:
                break  # the answer
            results = await self._tool_messages(calls, malformed, tools, traj.counts)
            suffix = tool_suffix_ids(self.tokenizer, results)
            if len(traj.response_ids) + len(suffix) >= max_new_tokens:
                break  # no room for the results and a turn after them (TRL drops them too)
            traj.messages += results
            traj.add(suffix, [], model=False)
            if share is not None:
                await share(suffix)
        return traj

    async def _tool_messages(self, calls, malformed: Optional[str], tools: dict[str, Callable],
                             counts: dict[str, int]) -> list[dict]:
        """The ``tool`` messages answering a turn's calls (or its malformed call)."""
        if malformed is not None:
            counts["malformed_calls"] += 1
            return [{"role": "tool", "name": "error", "content": json.dumps({"error": malformed})}]
        out = []
        for name, args in calls:
            counts["tool_calls"] += 1
            fn, error, result = tools.get(name), None, None
            if fn is None:
                error = f"no tool named {name!r}; the tools are {sorted(tools)}"
            elif not isinstance(args, dict):
                error = f"the arguments of {name!r} must be a JSON object, got {args!r}"
            else:
                try:
                    result = await asyncio.wait_for(self._call(fn, args), self.tool_timeout_s)
                except asyncio.TimeoutError:
                    counts["tool_timeouts"] += 1
                    error = f"{name} did not return within {self.tool_timeout_s:g} s"
                except Exception as e:  # the user's tool: any error is the model's to read
                    error = f"{name} raised {type(e).__name__}: {e}"
            if error is not None:
                counts["tool_errors"] += 1
            content = json.dumps({"error": error}) if error is not None else self._cut(str(result))
            out.append({"role": "tool", "name": name, "content": content})
        return out

    async def _call(self, fn: Callable, kwargs: dict[str, Any]) -> Any:
        """``fn(**kwargs)``: awaited where it is a coroutine function, else in a tool thread."""
        if inspect.iscoroutinefunction(fn):
            return await fn(**kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._threads, lambda: fn(**kwargs))

    def _cut(self, content: str) -> str:
        ids = self.tokenizer(content, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.max_tool_response_tokens:
            return content
        return self.tokenizer.decode(ids[:self.max_tool_response_tokens]) + TRUNCATED


def turn_counts(outputs: list) -> dict[str, int]:
    """A trajectory's spec-decode drafts and accepted draft tokens, of its
    first turn and of the turns after a tool message (each turn's
    ``RequestOutput``, ``completion_stats``): acceptance length by turn is
    1 + accepted / drafts."""
    first, later = completion_stats(outputs[:1]), completion_stats(outputs[1:])
    return {"drafts_first_turn": first.num_drafts, "accepted_first_turn": first.num_accepted_tokens,
            "drafts_after_tool": later.num_drafts, "accepted_after_tool": later.num_accepted_tokens}


def prompt_renderer(toolset: Toolset, tokenizer) -> Callable[[list[dict]], list[int]]:
    """The driver's ``agent_prompt_ids`` for ``toolset`` (the replicas
    render the same, ``AgentRunner.prompt_ids``)."""
    schemas, native = toolset.schemas, template_renders_tools(tokenizer)
    return lambda messages: agent_prompt_ids(tokenizer, messages, schemas, native)


def drafted_copies(prompt_ids: list[int], response_ids: list[int], loss_mask: list[int], replay) -> dict[str, int]:
    """Replay a text drafter (``NgramReplay``, ``SuffixReplay``) over one
    trajectory and say where its accepted drafts were copied from.

    A match drafter's draft is a function of the text so far, and a one-hot
    draft is accepted exactly when the sampled token equals it (Leviathan et
    al. 2023, Sec. 2.3), so the replica's verify steps are fixed by the
    tokens sampled (as ``draft.loss.replay_chains`` replays a head's): each
    turn (a run of ``loss_mask``) is one request that starts after its
    prefill's token; from chain start t the drafter drafts on the tokens up
    to t, the leading draft tokens equal to the sampled ones are accepted,
    one more token is sampled. Where an accepted token was copied from is
    the replay's to say (``copied_from_tool``).

    Args:
        prompt_ids / response_ids / loss_mask: one sample of a multi-turn
            ``RolloutBatch``.
        replay: ``replay_for``'s, of the replica's speculative config.

    Returns:
        {"drafts": steps that drafted, "accepted": draft tokens accepted,
        "accepted_from_tool": those copied from a tool output}; where the
        replay is vLLM's, drafts and accepted are the request's own counts
        (``jobs.bench_agent`` compares them).
    """
    tokens = list(prompt_ids) + list(response_ids)
    p = len(prompt_ids)
    tool = {p + i for i, m in enumerate(loss_mask) if not m}
    out = {"drafts": 0, "accepted": 0, "accepted_from_tool": 0}
    for first, last in mask_runs([p + i for i, m in enumerate(loss_mask) if m]):
        replay.start(tokens, first)  # the prefill samples the turn's first token
        t = first
        while t < last:
            draft, from_tool = replay.draft(tokens, t, tool)
            n = 0
            if draft:
                out["drafts"] += 1
                while n < min(len(draft), last - t) and draft[n] == tokens[t + 1 + n]:
                    out["accepted_from_tool"] += from_tool[n]
                    n += 1
                out["accepted"] += n
            replay.sampled(tokens[t + 1:t + n + 2])
            t += n + 1
    return out


class NgramReplay:
    """vLLM 0.32's n-gram drafter (prompt lookup, ``ngram_proposer``): the
    tokens after the earliest earlier occurrence of the longest of the
    context's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens, up
    to ``num_speculative_tokens`` (matched by ``_ngram_source``, not by
    vLLM's internal). A drafted token is copied from a tool output where the
    token it copies lies in a tool message."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max

    def start(self, tokens: list[int], first: int) -> None:
        pass  # stateless: a draft depends on the tokens alone

    def draft(self, tokens: list[int], t: int, tool: set[int]) -> tuple[list[int], list[bool]]:
        source = _ngram_source(tokens[:t + 1], self.min_n, self.max_n)
        if source is None or source > t:
            return [], []
        span = range(source, source + min(self.k, t + 1 - source))
        return [tokens[i] for i in span], [i in tool for i in span]

    def sampled(self, ids: list[int]) -> None:
        pass


class SuffixReplay:
    """vLLM 0.32's suffix drafter over a request's own text
    (``SuffixDecodingProposer`` with ``suffix_decoding_max_cached_requests``
    0; SuffixDecoding, arXiv 2411.04975), replayed through the same Arctic
    Inference cache and calls: a request's prompt starts its tree, each
    step's sampled tokens extend it, a draft speculates on the last
    ``max_tree_depth`` tokens. A suffix tree keeps no positions, so a
    drafted token counts as copied from a tool output where the matched
    context and the draft up to it occur in the text so far ending inside a
    tool message (the same text may also occur elsewhere)."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int, max_spec_factor: float,
                 min_token_prob: float):
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # vLLM's suffix method needs it

        self.k, self.depth = num_speculative_tokens, max_tree_depth
        self.factor, self.min_prob = max_spec_factor, min_token_prob
        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=0)
        self.turn = 0

    def start(self, tokens: list[int], first: int) -> None:
        if self.turn in self.cache.active_requests:
            self.cache.stop_request(self.turn)
        self.turn += 1
        self.cache.start_request(self.turn, tokens[:first])
        self.cache.add_active_response(self.turn, tokens[first:first + 1])

    def draft(self, tokens: list[int], t: int, tool: set[int]) -> tuple[list[int], list[bool]]:
        d = self.cache.speculate(self.turn, tokens[max(0, t + 1 - self.depth):t + 1], max_spec_tokens=self.k,
                                 max_spec_factor=self.factor, min_token_prob=self.min_prob)
        ends = [e for e in tool if e <= t]
        text = tokens[t + 1 - d.match_len:t + 1] + list(d.token_ids)
        return list(d.token_ids), [any(e + 1 >= n and tokens[e + 1 - n:e + 1] == text[:n] for e in ends)
                                   for n in range(d.match_len + 1, len(text) + 1)]

    def sampled(self, ids: list[int]) -> None:
        self.cache.add_active_response(self.turn, ids)


def replay_for(speculative_config, adaptive: bool):
    """The exact replay of a replica's drafter (``drafted_copies``), from
    vLLM's resolved ``SpeculativeConfig``; None where there is none: model
    drafters, a k that changes with the batch (adaptive k), and suffix drafts
    over vLLM's cache of other requests (their state is the replica's
    timing)."""
    spec = speculative_config
    if spec is None or adaptive:
        return None
    if spec.method == "ngram":
        return NgramReplay(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix" and spec.suffix_decoding_max_cached_requests == 0:
        return SuffixReplay(spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth,
                            spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)
    return None


def _ngram_source(tokens: list[int], min_n: int, max_n: int):
    """Where an n-gram draft of ``tokens`` starts copying: the index after
    the earliest occurrence, ending before the last token, of the longest
    suffix of ``max_n`` down to ``min_n`` tokens; None where none occurs."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        for s in range(size - n):
            if tokens[s:s + n] == suffix:
                return s + n
    return None

