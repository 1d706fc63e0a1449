"""Workloads W1/W2/W3 of issue 5 as lists of chat requests (OpenAI bodies), deterministic for a given scale.

Every request is a `Req`: a chat body (messages, tools, chat_template_kwargs), `max_tokens`, a label, and the
round it belongs to. A round is run against freshly started servers, so caches never carry over between
rounds; requests inside a round are sent in order. Sizes are targets in tokens of the served model's
tokenizer (`tokenize`: text -> token ids). Assistant turns are scripted (the synthetic model writes gibberish),
so every system sees exactly the same conversation.

    W1  one shared prefix: per round (a prefix size: about 420 and 2,000 tokens, a tools block of two schemas
        then a system prompt; and a max_tokens: 1 or 32), the requests A, B, C, D, X, X, Y, X.
    W2  history rewrite: one conversation of `w2_turns` turns with thinking on and a tool call per turn; each
        request ends with a tool result, and each new user turn makes the template drop the reasoning of the
        earlier assistant turns, so the prompt diverges from the previous one at that assistant message.
    W3  agent fleet: `w3_agents` agents share a tools block of `w3_tools_tokens`, each with its own system text,
        `w3_turns` requests each (a tool result of `w3_tool_min`-`w3_tool_max` tokens per turn), interleaved
        round-robin.

W4 and CHAT are closed loops (issue 12 item 3, issue 18 item 3), planned here as a `LoopPlan` and run by
bench/agentloop.py: the conversation grows from what the server actually answered, so only the parts the client
contributes (system texts, tasks, tool outputs, per-turn completion budgets) are fixed in advance.

    W4    agent tool loop: `w4_agents` agents at once, each a task of `w4_turns` turns over a shared tools block of
          `w4_tools_tokens` and its own system text; per turn a completion budget drawn from `w4_gen`, and a tool
          output of `w4_tool` tokens that arrives `w4_delay_s` after the answer.
    CHAT  a plain chat with thinking on: one conversation of `chat_turns` user turns, no tools, text answers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Callable

from bench.workloads import agent_system_prompt, agent_tools

Tokenize = Callable[[str], list[int]]

_WORDS = ("the cache keeps a snapshot of the recurrent state at every message boundary so that a later request "
          "restores it and prefills only the rest while the scheduler keeps serving other agents with their own "
          "tools results logs traces files tests and diffs of the repository under review today").split()


@dataclass(frozen=True)
class Scale:
    """Sizes of the three workloads (tokens are of the served model's tokenizer)."""

    # W1 rounds: (shared prefix target in tokens: tools block + system prompt, max_tokens)
    w1_rounds: tuple[tuple[int, int], ...] = ((420, 1), (420, 32), (2000, 1))
    w2_turns: int = 8
    w2_tool_tokens: tuple[int, int] = (60, 120)   # tool result size range, tokens
    w2_reasoning_tokens: int = 40
    w3_agents: int = 3
    w3_turns: int = 3
    w3_tools_tokens: int = 2000
    w3_tool_min: int = 200
    w3_tool_max: int = 600
    max_tokens: int = 8           # completion budget of W2/W3 requests
    ctx_size: int = 8192          # context size every server runs with, tokens
    # W4, the agent tool loop (issue 12 item 3)
    w4_agents: int = 3
    w4_turns: int = 6
    w4_tools_tokens: int = 2000
    w4_system_tokens: int = 150
    w4_gen: tuple[int, int] = (100, 400)      # completion budget per turn (max_tokens), drawn per agent and turn
    w4_tool: tuple[int, int] = (200, 1500)    # tool output per turn, tokens
    w4_delay_s: float = 0.2                   # the tool's run time: from the answer to the next request
    w4_ctx_size: int = 12288                  # context per agent (slot), tokens
    # CHAT, a plain chat with thinking on (issue 18 item 3)
    chat_turns: int = 4
    chat_user_tokens: int = 60
    chat_gen: tuple[int, int] = (100, 400)
    chat_delay_s: float = 1.0                 # the user's reading time between an answer and the next turn

    @staticmethod
    def named(name: str) -> "Scale":
        """'default' (about 35 min for four systems on 2 shared cores), 'quick' (a smoke run of every code
        path), 'compass' (the default with W3 at the compass scale of issue 12: 8 agents x 6 turns, tool
        results of 200-600 tokens as in the default), 'full' (issue 5 as written: W1 at both sizes x both
        budgets, 8 agents x 6 turns with 200-1,500 token tool results, 32-token completions; hours on 2 cores)."""
        if name == "default":
            return Scale()
        if name == "compass":
            return Scale(w3_agents=8, w3_turns=6)
        if name == "quick":
            return Scale(w1_rounds=((420, 1), (420, 8)), w2_turns=3, w3_agents=2, w3_turns=2,
                         w3_tools_tokens=800, w3_tool_min=100, w3_tool_max=200, max_tokens=8,
                         w4_agents=2, w4_turns=3, w4_tools_tokens=400, w4_system_tokens=60, w4_gen=(16, 32),
                         w4_tool=(40, 80), w4_ctx_size=4096, chat_turns=2, chat_user_tokens=30, chat_gen=(16, 32))
        if name == "full":
            return Scale(w1_rounds=((420, 1), (420, 32), (2000, 1), (2000, 32)), w2_tool_tokens=(200, 400),
                         w2_reasoning_tokens=120, w3_agents=8, w3_turns=6, w3_tool_min=200, w3_tool_max=1500,
                         max_tokens=32, ctx_size=16384)
        raise ValueError(f"unknown scale {name!r}")


@dataclass
class Req:
    """One request of a workload. body: chat fields (messages, tools, chat_template_kwargs); sizes in tokens."""

    workload: str
    round: str
    label: str
    body: dict
    max_tokens: int
    meta: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Identity of the prompt and budget (cold references are run once per key)."""
        return json.dumps([self.body, self.max_tokens], sort_keys=True)


def _words(rng: random.Random, tokenize: Tokenize, n_tokens: int, head: str = "") -> str:
    """Text of about `n_tokens` tokens (+/- a few) made of common words, starting with `head`."""
    words: list[str] = [head] if head else []
    while True:
        words.extend(rng.choice(_WORDS) for _ in range(16))
        if len(tokenize(" ".join(words))) >= n_tokens:
            break
    while len(words) > 1 and len(tokenize(" ".join(words))) > n_tokens:
        words.pop()
    return " ".join(words)


def _system(tokenize: Tokenize, name: str, target: int) -> str:
    """A system prompt of about `target` tokens whose first word differs between names (no shared text)."""
    base = agent_system_prompt(tokenize, max(target, 60))
    return f"{name}: " + base


def w1(tokenize: Tokenize, scale: Scale, prompt_tokens: Callable[[dict], int]) -> list[Req]:
    """W1 rounds: per prefix size and max_tokens, A B C D X X Y X (see the module docstring).

    prompt_tokens(body) -> tokens of the rendered prompt, used to size the system prompt so that tools block +
    system prompt is about the target size.
    """
    tools = agent_tools()
    tools_only = prompt_tokens({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "x"}],
                                "tools": tools})
    users = {
        "a": "Please look at the failing test in tests/test_cache.py and tell me which assertion fails and why.",
        "b": "Summarise the open pull requests that touch the scheduler, and list the reviewers who have not replied.",
        "c": "Which functions in orchestrator/engine.py call llama_decode, and do any of them skip chunking?",
        "x": "Draft a commit message for the change that bounds the snapshot cache by bytes instead of entries.",
        "y": "Explain in two sentences why a recurrent state cannot be truncated the way a KV cache can.",
    }
    out: list[Req] = []
    for size in sorted({sz for sz, _ in scale.w1_rounds}):
        sys_tokens = max(size - tools_only, 8)
        systems = {k: _system(tokenize, f"Session {k.upper()}", sys_tokens) if sys_tokens > 60
                   else f"Session {k.upper()}: you are a concise coding assistant."
                   for k in ("p", "c", "x", "y")}

        def body(sys_key: str, user: str) -> dict:
            return {"messages": [{"role": "system", "content": systems[sys_key]}, {"role": "user", "content": user}],
                    "tools": tools}

        seq = [("A", body("p", users["a"])), ("B", body("p", users["b"])), ("C", body("c", users["c"])),
               ("D", body("c", users["c"])), ("X", body("x", users["x"])), ("X again", body("x", users["x"])),
               ("Y", body("y", users["y"])), ("X after Y", body("x", users["x"]))]
        for mt in [m for sz, m in scale.w1_rounds if sz == size]:
            rnd = f"W1 {size} mt{mt}"
            out += [Req("W1", rnd, lab, b, mt, {"prefix_size": size}) for lab, b in seq]
    return out


def _tool_call(name: str, args: dict, reasoning: str, content: str = "") -> dict:
    return {"role": "assistant", "content": content, "reasoning_content": reasoning,
            "tool_calls": [{"id": "call_0", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args)}}]}


def w2(tokenize: Tokenize, scale: Scale) -> list[Req]:
    """W2: one conversation, thinking on, a request after each turn's tool result (see the module docstring)."""
    rng = random.Random(2)
    tools = agent_tools()
    msgs: list[dict] = [{"role": "system", "content": "You are Orchard, a coding agent. Think before you act."}]
    out: list[Req] = []
    for t in range(scale.w2_turns):
        msgs.append({"role": "user", "content": f"Turn {t + 1}. " + _words(rng, tokenize, 40)})
        call = _tool_call("search_code", {"pattern": f"def step_{t}", "path": "orchestrator/"},
                          _words(rng, tokenize, scale.w2_reasoning_tokens, "I should search first:"))
        call["tool_calls"][0]["id"] = f"call_w2_{t}"
        msgs.append(call)
        lo, hi = scale.w2_tool_tokens
        msgs.append({"role": "tool", "tool_call_id": f"call_w2_{t}",
                     "content": _words(rng, tokenize, rng.randint(lo, hi), f"results for step_{t}:")})
        out.append(Req("W2", "W2", f"turn {t + 1}", {"messages": [dict(m) for m in msgs], "tools": tools},
                       scale.max_tokens, {"turn": t + 1}))
        # The assistant's answer after the tool result; its reasoning is dropped once the next user turn comes.
        msgs.append({"role": "assistant", "content": _words(rng, tokenize, 40, "Found it."),
                     "reasoning_content": _words(rng, tokenize, scale.w2_reasoning_tokens // 2, "The result shows")})
    return out


def fleet_tools(tokenize: Tokenize, target: int) -> list[dict]:
    """Tool schemas whose JSON is about `target` tokens in total (the shared W3 tools block)."""
    rng = random.Random(3)
    tools: list[dict] = []
    total = 0
    i = 0
    while total < target * 0.8:
        i += 1
        desc = _words(rng, tokenize, 90, f"Tool {i}:")
        t = {"type": "function", "function": {
            "name": f"tool_{i}_{rng.choice(_WORDS)}", "description": desc,
            "parameters": {"type": "object", "properties": {
                "target": {"type": "string", "description": _words(rng, tokenize, 12, "what to act on;")},
                "limit": {"type": "integer", "minimum": 1, "maximum": 500},
                "dry_run": {"type": "boolean", "default": False}}, "required": ["target"]}}}
        tools.append(t)
        total += len(tokenize(json.dumps(t)))
    return tools


def w3(tokenize: Tokenize, scale: Scale, prompt_tokens: Callable[[dict], int]) -> list[Req]:
    """W3: an agent fleet sharing a tools block, interleaved round-robin (see the module docstring)."""
    rng = random.Random(4)
    tools = fleet_tools(tokenize, scale.w3_tools_tokens)
    convs: list[list[dict]] = []
    for a in range(scale.w3_agents):
        system = (f"Agent {a + 1} of the fleet. " + _words(rng, tokenize, 120, f"Persona {a + 1}: you handle"))
        convs.append([{"role": "system", "content": system},
                      {"role": "user", "content": f"Task {a + 1}: " + _words(rng, tokenize, 60)}])
    out: list[Req] = []
    for t in range(scale.w3_turns):
        for a, msgs in enumerate(convs):
            if t > 0:
                cid = f"call_w3_{a}_{t}"
                call = _tool_call(tools[(a + t) % len(tools)]["function"]["name"], {"target": f"file_{a}_{t}.py"},
                                  _words(rng, tokenize, 30, "Next I check"))
                call["tool_calls"][0]["id"] = cid
                msgs.append(call)
                size = rng.randint(scale.w3_tool_min, scale.w3_tool_max)
                msgs.append({"role": "tool", "tool_call_id": cid, "content": _words(rng, tokenize, size, "output:")})
            out.append(Req("W3", "W3", f"agent {a + 1} turn {t + 1}",
                           {"messages": [dict(m) for m in msgs], "tools": tools}, scale.max_tokens,
                           {"agent": a + 1, "turn": t + 1}))
    return out


# ---------------------------------------------------------------------------------------------- closed loops


@dataclass
class AgentTask:
    """One conversation of a closed loop: its system text (None: no system message) and first user message, and
    per turn the completion budget and the text the client sends after that turn's answer (a tool output on W4,
    the next user message on CHAT; the last turn's is never sent)."""

    agent: int
    system: str | None
    task: str
    max_tokens: list[int]
    replies: list[str]


@dataclass
class LoopPlan:
    """A closed-loop workload: agents run at once, each turn waits `delay_s` after its answer before the next
    request. follow: 'tool' (the reply is a tool output: `tool` messages answering the answer's tool calls, or a
    user message when it called none) or 'user' (the reply is the next user turn)."""

    workload: str
    tools: list[dict] | None
    agents: list[AgentTask]
    delay_s: float
    follow: str
    chat_template_kwargs: dict | None = None


def _draw(workload: str, agent: int, turn: int, what: str, lo: int, hi: int) -> int:
    """A size in [lo, hi] seeded by (workload, agent, turn, what) alone: the same for every system and run."""
    return random.Random(f"{workload}/{agent}/{turn}/{what}").randint(lo, hi)


def w4(tokenize: Tokenize, scale: Scale) -> LoopPlan:
    """W4: `w4_agents` agent tool loops at once over one shared tools block (see the module docstring)."""
    tools = fleet_tools(tokenize, scale.w4_tools_tokens)
    agents = []
    for a in range(1, scale.w4_agents + 1):
        rng = random.Random(f"W4/{a}/text")
        system = f"Agent {a} of the tool loop. " + _words(rng, tokenize, scale.w4_system_tokens, f"Persona {a}: you")
        task = f"Task {a}: " + _words(rng, tokenize, 60)
        budgets = [_draw("W4", a, t, "gen", *scale.w4_gen) for t in range(scale.w4_turns)]
        replies = [f"output of call {t + 1} of agent {a}: " + _words(
            random.Random(f"W4/{a}/{t}/tool text"), tokenize, _draw("W4", a, t, "tool", *scale.w4_tool))
            for t in range(scale.w4_turns - 1)]
        agents.append(AgentTask(a, system, task, budgets, replies))
    return LoopPlan("W4", tools, agents, scale.w4_delay_s, "tool")


def chat(tokenize: Tokenize, scale: Scale) -> LoopPlan:
    """CHAT: one plain conversation with thinking on (the template's default), text answers, no tools."""
    rng = random.Random("CHAT/text")
    users = [f"Question {t + 1}: " + _words(rng, tokenize, scale.chat_user_tokens) for t in range(scale.chat_turns)]
    budgets = [_draw("CHAT", 1, t, "gen", *scale.chat_gen) for t in range(scale.chat_turns)]
    return LoopPlan("CHAT", None, [AgentTask(1, "You are a helpful assistant. Think before you answer.", users[0],
                                             budgets, users[1:])], scale.chat_delay_s, "user")


def answer_message(content: str, reasoning: str, tool_calls: list[dict]) -> dict:
    """The assistant message as the server returned it (OpenAI shape): content, reasoning_content when there was
    any, tool_calls when there were any (arguments as the JSON string streamed)."""
    msg: dict = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def follow_up(answer: dict, reply: str, follow: str, call_id: str) -> list[dict]:
    """What the client appends after an answer: the answer itself, then the reply. On a tool loop ('tool') the
    reply is the tool's output: one `tool` message per returned tool call (the output on the first, an empty
    result on the others), or a user message carrying the output when the answer called no tool (a random-weight
    model almost never emits a well-formed call; a `tool` message without a call is not valid OpenAI input).
    On 'user' the reply is the next user message."""
    out = [answer]
    calls = answer.get("tool_calls") or []
    if follow == "tool" and calls:
        out += [{"role": "tool", "tool_call_id": c.get("id") or f"{call_id}_{i}", "content": reply if i == 0 else ""}
                for i, c in enumerate(calls)]
    else:
        out.append({"role": "user", "content": reply})
    return out
