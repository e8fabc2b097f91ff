"""Multi-turn rollouts with tools (``rayspec.rollout.agent``): the toolset
and its refusals, the tool messages' tokens, a trajectory driven by a
scripted model, and the loss mask's reach (no gradient from a tool token,
to the policy or to the draft head)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import torch

from rayspec.batch import RolloutBatch
from rayspec.rollout.agent import (TEXT_FORMAT, AgentRunner, NgramReplay, SuffixReplay, ToolError, Toolset,
                                   agent_prompt_ids, check_template, drafted_copies, template_renders_tools,
                                   tool_suffix_ids)
from tests.conftest import engine_kwargs

TOOLS = '''
import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: the dividend.
        b: the divisor.
    """
    return a / b


def wait(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "done"


def untyped(a, b):
    """Add.

    Args:
        a: one.
        b: two.
    """
    return a + b


def undocumented(a: int) -> int:
    return a


class Ledger:
    def reset(self, **row):
        self.calls = []
        self.answer = row["answer"]
        return " (use the ledger)"

    def record(self, note: str) -> str:
        """Write a note in the ledger.

        Args:
            note: what to write.
        """
        self.calls.append(note)
        return f"noted {len(self.calls)}"

    def get_reward(self) -> float:
        return float(len(self.calls))


class NoReset:
    def look(self, x: int) -> int:
        """Look.

        Args:
            x: where.
        """
        return x
'''


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOLS)
    return path


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from rayspec.models import load_tokenizer

    return load_tokenizer(smollm2_dir)


def test_tools_without_type_hints_or_docstring_and_environments_without_reset_are_refused(tools_file):
    ok = Toolset.load([f"{tools_file}:multiply"], f"{tools_file}:Ledger")
    names = [s["function"]["name"] for s in ok.schemas]
    assert names == ["multiply", "record"]  # reset and get_reward are no tools; the schema from hints and docstring
    assert ok.reward_name() == "Ledger" and Toolset.load([f"{tools_file}:multiply"], None).reward_name() is None
    assert ok.schemas[0]["function"]["parameters"]["properties"]["a"] == {"type": "integer",
                                                                             "description": "the first factor."}
    for spec, env, words in ((f"{tools_file}:untyped", None, ["rollout.tools[0]", "untyped", "type hints"]),
                             (f"{tools_file}:undocumented", None, ["rollout.tools[0]", "docstring"]),
                             (f"{tools_file}:nothing", None, ["rollout.tools[0]", "has no 'nothing'"]),
                             (f"{tools_file}:Ledger", None, ["a type, not a function"]),
                             (None, f"{tools_file}:NoReset", ["rollout.environment", "NoReset", "reset"]),
                             (None, f"{tools_file}:multiply", ["rollout.environment", "not a class"])):
        with pytest.raises(ToolError) as e:
            Toolset.load([spec] if spec else [], env)
        assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ToolError, match="second tool named 'multiply'"):
        Toolset.load([f"{tools_file}:multiply", f"{tools_file}:multiply"], None)


def test_a_template_that_cannot_render_tool_messages_is_refused(tokenizer):
    check_template(tokenizer, "smollm2")  # ChatML renders any role
    plain = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    plain.chat_template = "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(ToolError, match="model.path=x: its chat template cannot render a tool message"):
        check_template(plain, "x")


def test_the_tools_go_into_the_system_prompt_of_a_template_without_tool_support(tokenizer, tools_file):
    schemas = Toolset.load([f"{tools_file}:multiply"], None).schemas
    assert not template_renders_tools(tokenizer)  # SmolLM2's ChatML template ignores tools=
    text = tokenizer.decode(agent_prompt_ids(tokenizer, [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "12 * 34?"}], schemas, False))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")
    assert json.dumps(schemas[0]) in text and "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")
    assert TEXT_FORMAT.splitlines()[0] in text


def test_tool_messages_follow_the_models_eos_as_the_template_renders_them(tokenizer):
    suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "multiply", "content": "408"}])
    # the model wrote <|im_end|>; the template's newline after it, the tool turn and the next assistant turn follow
    assert tokenizer.decode(suffix) == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"


def _out(tokenizer, text: str, eos: bool = True, first_lp: float = -0.5):
    """A vLLM RequestOutput of one sample writing ``text`` (then EOS)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * eos
    lps = [{t: SimpleNamespace(logprob=first_lp - i / 100)} for i, t in enumerate(ids)]
    c = SimpleNamespace(token_ids=ids, logprobs=lps, weight_versions=[SimpleNamespace(version="3", start=0,
                                                                                     end=len(ids))],
                        spec_decode_metrics=SimpleNamespace(histogram=[1, 2, 1], num_draft_tokens=8))
    return SimpleNamespace(outputs=[c])


def _script(tokenizer, turns: list[str]):
    """A model that writes ``turns`` in order; records each prompt it was given."""
    seen = []

    async def generate(ids, max_tokens):
        seen.append((list(ids), max_tokens))
        return _out(tokenizer, turns[len(seen) - 1])
    return generate, seen


def _call(name, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_a_trajectory_keeps_the_tokens_as_generated_and_masks_the_tool_messages(tokenizer, tools_file):
    toolset = Toolset.load([f"{tools_file}:multiply"], f"{tools_file}:Ledger")
    runner = AgentRunner(toolset, tokenizer, max_turns=4)
    messages = [{"role": "user", "content": "What is 12 * 34?"}]
    row = {"prompt": messages, "answer": "408"}
    turns = [_call("multiply", a=12, b=34), _call("record", note="408"), "The answer is 408."]
    generate, seen = _script(tokenizer, turns)
    shared = []

    async def share(ids):  # what the group-suffix drafter is handed
        shared.append((list(ids), len(seen)))

    t = asyncio.run(runner.run(generate, runner.prompt_ids(messages), row, 400, share=share))
    # reset's string went to the last user message before the first turn
    first_prompt = seen[0][0]
    assert first_prompt == runner.prompt_ids([{"role": "user", "content": "What is 12 * 34? (use the ledger)"}])
    assert t.environment.calls == ["408"] and t.environment.answer == "408"
    # every turn was generated on exactly the tokens the trainer sees before it: no re-tokenization
    for ids, max_tokens in seen:
        assert ids == first_prompt + t.response_ids[:len(ids) - len(first_prompt)]
        assert max_tokens == 400 - (len(ids) - len(first_prompt))
    model = [tokenizer(x, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for x in turns]
    suffix = [tool_suffix_ids(tokenizer, [m]) for m in t.messages if m["role"] == "tool"]
    assert t.response_ids == model[0] + suffix[0] + model[1] + suffix[1] + model[2]
    assert shared == [(suffix[0], 1), (suffix[1], 2)]  # each tool message, before the turn that reads it
    assert t.loss_mask == [1] * len(model[0]) + [0] * len(suffix[0]) + [1] * len(model[1]) + \
        [0] * len(suffix[1]) + [1] * len(model[2])
    assert [lp for lp, m in zip(t.logprobs, t.loss_mask) if not m] == [0.0] * (len(suffix[0]) + len(suffix[1]))
    assert t.logprobs[:2] == [-0.5, -0.51]
    assert [m["role"] for m in t.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert t.messages[1] == {"role": "tool", "name": "multiply", "content": "408"}
    assert t.messages[3]["content"] == "noted 1" and t.messages[4]["content"] == "The answer is 408."
    assert t.counts == {"turns": 3, "tool_calls": 2, "tool_errors": 0, "tool_timeouts": 0, "malformed_calls": 0}
    # vLLM's version spans, moved to the turn's place in the response
    start2 = len(model[0]) + len(suffix[0])
    assert t.weight_versions[1] == (3, start2, start2 + len(model[1]))
    # as the trainer pads it: the tool tokens are off the response mask
    batch = RolloutBatch([first_prompt], [t.response_ids], [t.logprobs], [0], loss_mask=[t.loss_mask],
                         advantages=[1.0])
    padded = batch.to_padded(tokenizer.pad_token_id)
    p = len(first_prompt)
    assert padded["response_mask"][0, p - 1:].tolist() == [float(m) for m in t.loss_mask]
    assert padded["response_mask"][0, :p - 1].sum() == 0


def test_bad_calls_are_told_to_the_model_and_counted_and_the_trajectory_goes_on(tokenizer, tools_file):
    toolset = Toolset.load([f"{tools_file}:divide", f"{tools_file}:wait"], None)
    runner = AgentRunner(toolset, tokenizer, max_turns=6, tool_timeout_s=0.5, max_tool_response_tokens=5)
    turns = ['<tool_call>\n{"name": "divide", "arguments": {"a": 1, \n</tool_call>',  # malformed JSON
             _call("divide", a=1, b=0),  # raises
             _call("wait", seconds=3),  # outruns tool_timeout_s
             _call("lookup", key="x"),  # no such tool
             _call("divide", a=1, b=3),  # a result longer than max_tool_response_tokens
             "Done."]
    generate, seen = _script(tokenizer, turns)
    t0 = time.monotonic()
    t = asyncio.run(runner.run(generate, runner.prompt_ids([{"role": "user", "content": "go"}]), {}, 900))
    assert time.monotonic() - t0 < 2.5  # the hung tool was not waited for
    tool = [m["content"] for m in t.messages if m["role"] == "tool"]
    assert "could not parse the tool call" in json.loads(tool[0])["error"]
    assert json.loads(tool[1]) == {"error": "divide raised ZeroDivisionError: division by zero"}
    assert json.loads(tool[2]) == {"error": "wait did not return within 0.5 s"}
    assert "no tool named 'lookup'" in json.loads(tool[3])["error"]
    assert tool[4] == tokenizer.decode(tokenizer("0.3333333333333333")["input_ids"][:5]) + " ... [truncated]"
    assert t.counts == {"turns": 6, "tool_calls": 4, "tool_errors": 3, "tool_timeouts": 1, "malformed_calls": 1}
    assert t.messages[-1] == {"role": "assistant", "content": "Done."}


def test_a_trajectory_ends_at_max_turns_at_a_turn_cut_by_max_tokens_and_where_results_do_not_fit(
        tokenizer, tools_file):
    runner = AgentRunner(Toolset.load([f"{tools_file}:multiply"], None), tokenizer, max_turns=2)
    prompt = runner.prompt_ids([{"role": "user", "content": "go"}])
    generate, seen = _script(tokenizer, [_call("multiply", a=2, b=3)] * 3)
    t = asyncio.run(runner.run(generate, prompt, {}, 400))
    assert t.counts["turns"] == 2 and t.counts["tool_calls"] == 1 and t.loss_mask[-1] == 1  # no tool after the last

    async def cut(ids, max_tokens):
        return _out(tokenizer, _call("multiply", a=2, b=3), eos=False)
    t = asyncio.run(runner.run(cut, prompt, {}, 400))
    assert t.counts == {"turns": 1, "tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "malformed_calls": 0}
    # the results and a turn after them do not fit in max_new_tokens: the trajectory ends before them (as TRL's)
    generate, seen = _script(tokenizer, [_call("multiply", a=2, b=3)])
    first = len(tokenizer(_call("multiply", a=2, b=3), add_special_tokens=False)["input_ids"]) + 1
    t = asyncio.run(runner.run(generate, prompt, {}, first + 5))
    assert t.loss_mask == [1] * first and [m["role"] for m in t.messages] == ["assistant"]


def test_a_tool_token_gives_the_policy_no_gradient():
    """The GRPO loss (and its KL term) of a sequence whose response holds a
    tool message: the logits that predict the tool's tokens get exactly zero
    gradient; those that predict the model's tokens do not."""
    from rayspec.train.grpo import grpo_loss, token_logprobs

    torch.manual_seed(0)
    prompt, response = [5, 6, 7], [10, 11, 12, 13, 14, 15, 16]
    mask = [1, 1, 0, 0, 0, 1, 1]  # two model tokens, three tool tokens, two model tokens
    batch = RolloutBatch([prompt, prompt], [response, response[:4]], [[-1.0] * 7, [-1.0] * 4], [0, 0],
                         loss_mask=[mask, mask[:4]], advantages=[1.0, -0.5])
    t = batch.to_padded(0)
    logits = torch.randn(2, 10, 32, requires_grad=True)
    lp = token_logprobs(logits, t["input_ids"])
    loss, _ = grpo_loss(lp, t["rollout_logprobs"], t["advantages"], t["response_mask"], 0.2,
                        ref_logprobs=lp.detach() - 0.1, kl_coef=0.5)
    loss.backward()
    grad = logits.grad.abs().sum(-1)  # [B, L]: position s predicts token s + 1
    tool = [len(prompt) - 1 + i for i, m in enumerate(mask) if not m]
    model = [len(prompt) - 1 + i for i, m in enumerate(mask) if m]
    assert grad[0, tool].max() == 0 and (grad[0, model] > 0).all()
    assert grad[1, [4, 5]].max() == 0 and (grad[1, [2, 3]] > 0).all()


def test_a_tool_token_is_no_draft_target(tiny_llama_dir):
    """The EAGLE-3 loss on a multi-turn sample does not change whatever the
    verifier says at the positions whose next token a tool wrote: those
    positions carry no draft target (the head still reads the tool tokens
    as context)."""
    from rayspec.draft.capture import capture_eagle3_features
    from rayspec.draft.eagle3 import init_head
    from rayspec.draft.loss import eagle3_loss, verifier_normalizers
    from rayspec.models import load_policy

    policy = load_policy(tiny_llama_dir)
    torch.manual_seed(0)
    head = init_head(policy)
    seq = torch.randint(0, 256, (1, 14))
    mask = torch.zeros(1, 13)
    mask[0, 2:5] = 1  # a first turn
    mask[0, 9:] = 1  # a turn after a tool message at 6..9 (positions 5..8 predict it)
    with torch.no_grad(), capture_eagle3_features(policy, [1, 3, 4]) as f:
        policy(input_ids=seq)

    def loss(final_hidden):
        feats = {"input_ids": seq, "aux_hidden": f["aux_hidden"], "final_hidden": final_hidden, "loss_mask": mask,
                 **verifier_normalizers(final_hidden, mask, policy.lm_head.weight)}
        return eagle3_loss(head, feats, policy.model.embed_tokens.weight, head.draft_rows(policy.lm_head.weight),
                           3)[0]

    base = loss(f["final_hidden"])
    other = f["final_hidden"].clone()
    other[0, 5:9] = torch.randn_like(other[0, 5:9]) * 10  # what the verifier says of the tool's tokens
    assert loss(other).item() == pytest.approx(base.item(), abs=1e-6)
    other[0, 10] += torch.randn_like(other[0, 10]) * 10  # a model token's target moves the loss
    assert loss(other).item() != pytest.approx(base.item(), abs=1e-4)
    base.backward()
    assert head.fc.weight.grad.abs().sum() > 0


def test_replay_treats_each_turn_as_its_own_decode():
    """A multi-turn sample replays turn by turn: each turn's first token is
    its prefill's, drafts do not run into the tool tokens after it."""
    from rayspec.draft.loss import replay_chains

    hits = torch.ones(1, 12, 3, dtype=torch.bool)  # every draft would match
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]], dtype=torch.float)  # turns at tokens 2-5 and 8-11
    (n, chains), = replay_chains(hits, mask, 3)
    assert n == 8
    # turn 1: token 2 from the prefill, one step drafts 3 and accepts them (3-5); turn 2 the same (9-11)
    assert chains == [(1, 3), (5, 3)]
    assert replay_chains(hits, torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.float), 3)[0] == \
        (10, [(1, 3), (5, 3), (9, 1)])


def _suffix_proposer(max_cached_requests: int, k: int = 3):
    """vLLM's own suffix proposer (no engine: its config is all it reads)."""
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    spec = SimpleNamespace(num_speculative_tokens=k, suffix_decoding_max_tree_depth=24,
                           suffix_decoding_max_cached_requests=max_cached_requests,
                           suffix_decoding_max_spec_factor=2.0, suffix_decoding_min_token_prob=0.1)
    return SuffixDecodingProposer(SimpleNamespace(speculative_config=spec,
                                                  model_config=SimpleNamespace(max_model_len=1024)))


def _input_batch(req_id: str, tokens: list[int], num_prompt_tokens: int):
    """What ``SuffixDecodingProposer.propose`` reads of vLLM's input batch, for one request."""
    import numpy as np

    ids = np.zeros((1, 1024), dtype=np.int32)
    ids[0, :len(tokens)] = tokens
    return SimpleNamespace(req_ids=[req_id], req_id_to_index={req_id: 0}, num_tokens_no_spec=[len(tokens)],
                           num_prompt_tokens=[num_prompt_tokens], token_ids_cpu=ids)


def test_the_suffix_replay_drafts_what_vllms_suffix_proposer_drafts():
    """``SuffixReplay`` feeds Arctic Inference's cache as vLLM's proposer
    does (a turn's prompt, then each step's sampled tokens): driven through
    the same verify steps, vLLM's proposer drafts the same tokens; the answer
    after the tool message is drafted from it."""
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]
    tool = [20, 21, 7, 8, 9, 40, 50, 22]
    response = [11, 1, 2, 3, 4, 5, 2] + tool + [7, 8, 9, 40, 50, 30, 2]
    mask = [1] * 7 + [0] * len(tool) + [1] * 7
    drafts = []

    class Recorded(SuffixReplay):
        def draft(self, tokens, t, tool):
            out = super().draft(tokens, t, tool)
            drafts.append(out[0])
            return out

    got = drafted_copies(prompt, response, mask, Recorded(3, 24, 2.0, 0.1))
    vllm = _suffix_proposer(0)
    tokens, want = prompt + response, []
    for turn, (first, last) in enumerate([(10, 16), (25, 31)]):
        t, sampled = first, [tokens[first]]
        while t < last:  # the verify steps the sampled tokens fix (drafted_copies' rule)
            draft, = vllm.propose(3, _input_batch(f"turn{turn}", tokens[:t + 1], first), [sampled])
            want.append(draft)
            n = 0
            while n < min(len(draft), last - t) and draft[n] == tokens[t + 1 + n]:
                n += 1
            sampled = tokens[t + 1:t + n + 2]
            t += n + 1
    assert drafts == want and any(want)
    assert got["accepted_from_tool"] > 0 and got["accepted_from_tool"] <= got["accepted"]
    # the same answer with the tool's tokens written by the model: accepted, copied from no tool output
    assert drafted_copies(prompt, response, [1] * len(response), SuffixReplay(3, 24, 2.0, 0.1))[
        "accepted_from_tool"] == 0


def test_group_suffix_drafts_other_trajectories_from_a_tool_output():
    """vLLM's suffix proposer drafts a request from its own prompt and from
    other requests' responses; a tool output is a prompt, so the worker
    indexes it as text of its own (``rayspec_index_suffix_text``): another
    trajectory whose text reaches the tool output's start drafts its
    continuation. With vLLM's cache of other requests off, nothing is
    indexed."""
    from rayspec.rollout.agent import replay_for
    from rayspec.vllm.worker_ext import RefitExtension

    for cached, want in ((16, [[9, 40, 50]]), (0, [[]])):
        worker = RefitExtension()
        worker.model_runner = SimpleNamespace(drafter=_suffix_proposer(cached))
        assert worker.rayspec_index_suffix_text([20, 21, 7, 8, 9, 40, 50, 22]) == (cached > 0)
        assert worker.model_runner.drafter.propose(3, _input_batch("sibling", [1, 2, 3, 7, 8], 4), [[8]]) == want
        # an exact replay only where the drafter's cache is the trajectory's own text
        spec = SimpleNamespace(method="suffix", num_speculative_tokens=3, suffix_decoding_max_cached_requests=cached,
                               suffix_decoding_max_tree_depth=24, suffix_decoding_max_spec_factor=1.0,
                               suffix_decoding_min_token_prob=0.1)
        assert isinstance(replay_for(spec, adaptive=False), SuffixReplay) == (cached == 0)
        assert replay_for(spec, adaptive=True) is None


@pytest.mark.slow
def test_trajectories_on_vllm_are_the_sequences_the_trainer_scores(smollm2_dir, tmp_path):
    """The tool-use example on vLLM's AsyncLLM with n-gram drafts: the
    model calls the tool, reads its result, and answers; the trainer's
    padded batch is token for token what vLLM generated on, so the policy's
    own logprobs of the model's tokens are the engine's (no re-tokenization
    between turns), and the tool's tokens are those the template renders,
    masked off."""
    import subprocess
    import sys

    from rayspec.models import load_policy
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env
    from rayspec.train.grpo import token_logprobs, token_mult_prob_error

    subprocess.run([sys.executable, "examples/tool_use/make_data.py", str(tmp_path)], check=True)
    rows = [json.loads(line) for line in (tmp_path / "test.jsonl").read_text().splitlines()[:6]]
    engine = SpecVLLMEngine(str(smollm2_dir), {"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                            dtype="float32", engine_kwargs=engine_kwargs(max_model_len=1024),
                            env=cpu_engine_env(1, "all"), engine_cls="async",
                            agent={"tools": ["examples/tool_use/tools.py:multiply"], "max_turns": 3})
    try:
        prompts = [engine.agent.prompt_ids(r["prompt"]) for r in rows]
        batch, stats = engine.generate(prompts, n=3, max_tokens=120, rows=rows, seed=1)
        tokenizer = engine.agent.tokenizer
    finally:
        engine.shutdown()
    assert len(batch) == 18 and batch.group == [g for g in range(6) for _ in range(3)]
    answered = [i for i, c in enumerate(batch.tool_counts) if c["tool_calls"] > c["tool_errors"] and c["turns"] >= 2]
    assert answered, batch.completions  # the worked example in the prompt gets the 135M model to call the tool
    for i in answered:
        mask, ids = batch.loss_mask[i], batch.response_ids[i]
        start = mask.index(0)
        end = start + mask[start:].index(1)
        tool = next(m for m in batch.completions[i] if m["role"] == "tool")
        assert ids[start:end] == tool_suffix_ids(tokenizer, [tool])
        assert ids[start - 1] == tokenizer.eos_token_id  # the model's turn ended on EOS, as generated
    assert stats.num_drafts > 0 and sum(c["drafts_after_tool"] for c in batch.tool_counts) > 0
    # n-gram drafts at a fixed k: each trajectory's accepted drafts copied from its tool message, by replay
    for c, p, r, m in zip(batch.tool_counts, batch.prompt_ids, batch.response_ids, batch.loss_mask):
        assert c["accepted_from_tool"] == drafted_copies(p, r, m, NgramReplay(3, 2, 4))["accepted_from_tool"]
        assert c["accepted_from_tool"] <= c["accepted_after_tool"]  # vLLM's own count of those turns
    # an answer that repeats the tool's number is drafted from the tool message
    copied = [i for i in answered if batch.completions[i][-1]["content"].strip() == batch.completions[i][1]["content"]]
    assert sum(batch.tool_counts[i]["accepted_from_tool"] for i in copied) > 0 or not copied
    # the trainer scores the multi-turn samples (a forward of up to 4: 49k-token logits of 400-token sequences)
    picked = RolloutBatch.gather([(batch, answered[:4])])
    t = picked.to_padded(tokenizer.pad_token_id)
    policy = load_policy(smollm2_dir, torch.float32)
    with torch.no_grad():
        lp = token_logprobs(policy(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits,
                            t["input_ids"])
    assert token_mult_prob_error(lp, t["rollout_logprobs"], t["response_mask"]) < 0.02
    assert t["response_mask"].sum() == sum(map(sum, picked.loss_mask)) < sum(map(len, picked.response_ids))


def test_a_multi_turn_run_is_checked_before_ray_starts(tmp_path, tools_file, smollm2_dir):
    """``check_inputs`` refuses what cannot run multi-turn, naming the key,
    file or row; the config refuses bad values."""
    from rayspec.config import ConfigError, load_config
    from rayspec.preflight import check_inputs

    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "1"})
                                         + "\n")
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": "hi", "answer": "1"}) + "\n")
    (tmp_path / "env.py").write_text("class Broken:\n    def __init__(self):\n        raise OSError('no sandbox')\n"
                                     "    def reset(self, **row):\n        pass\n")

    def check(*overrides, data="chat.jsonl"):
        cfg = load_config(None, ["data.name=files", f"data.path={tmp_path / data}", "trainer.eval_every=0",
                                 f"model.cache_dir={smollm2_dir.parents[1]}", *overrides])
        return check_inputs(cfg)

    check(f"rollout.tools=[{tools_file}:multiply]")  # passes
    for overrides, data, words in (
            ([f"rollout.tools=[{tools_file}:untyped]"], "chat.jsonl", ["rollout.tools[0]", "type hints"]),
            ([f"rollout.environment={tools_file}:NoReset"], "chat.jsonl", ["rollout.environment", "reset"]),
            ([f"rollout.environment={tmp_path}/env.py:Broken"], "chat.jsonl",
             ["rollout.environment", "Broken() raised OSError: no sandbox"]),
            ([f"rollout.tools=[{tools_file}:multiply]", "rollout.tool_parser=nosuch"], "chat.jsonl",
             ["rollout.tool_parser='nosuch'", "hermes"]),
            ([f"rollout.tools=[{tools_file}:multiply]"], "plain.jsonl", ["row 0 of", "plain.jsonl", "string prompt"])):
        with pytest.raises(ConfigError) as e:
            check(*overrides, data=data)
        assert all(w in str(e.value) for w in words), str(e.value)
    for override, words in (("rollout.max_turns=0", "rollout.max_turns=0: must be an integer >= 1"),
                            ("rollout.engine_cls=offline", "rollout.engine_cls='offline'"),
                            ("rollout.tool_timeout_s=0", "rollout.tool_timeout_s=0")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, [f"rollout.tools=[{tools_file}:multiply]", override])
