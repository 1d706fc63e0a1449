"""Reasoning and tool-call parsing per template family, on fixed strings (no model).

Each format is chosen from the template (tests/templates); the round-trip tests render an assistant tool-call
turn with the family's own template and parse it back, so parser and template agree on the syntax.
"""

import json
import random

import pytest

from orchestrator.output.formats import detect_format
from orchestrator.output.parsing import make_stream_parser, parse_output

from .test_boundaries import TEMPLATES, template

FAMILY = {
    "Qwen3.5-4B": "qwen-xml", "Qwen3-Coder": "qwen-xml", "Qwen-Qwen3-0.6B": "hermes",
    "ibm-granite-granite-4.0": "hermes", "HuggingFaceTB-SmolLM3-3B": "hermes", "google-gemma-2-2b-it": "hermes",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek-r1", "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "NVIDIA-Nemotron-Nano-v2": "nemotron", "LFM2.5-Instruct": "lfm2", "meta-llama-Llama-3.1-8B-Instruct": "llama3-json",
    "openai-gpt-oss-120b": "harmony",
}
THINKS = {"Qwen3.5-4B", "Qwen-Qwen3-0.6B", "HuggingFaceTB-SmolLM3-3B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
          "NVIDIA-Nemotron-Nano-v2", "LFM2.5-Instruct"}


def fmt_of(name):
    return detect_format((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_format_is_detected_from_the_template(name):
    fmt = fmt_of(name)
    assert fmt.name == FAMILY[name]
    assert (fmt.think is not None) == (name in THINKS)


ARGS = {"city": "Paris", "days": 3, "opts": {"metric": True}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "opts": {"type": "object"}}}}}]
EOT = ("<|im_end|>", "<|eot_id|>", "</s>", "<｜end▁of▁sentence｜>", "<|call|>", "<|end_of_text|>", "<SPECIAL_12>")
RENDERS_CALLS = sorted(set(FAMILY) - {"google-gemma-2-2b-it", "HuggingFaceTB-SmolLM3-3B", "LFM2.5-Instruct"})


@pytest.mark.parametrize("name", RENDERS_CALLS)
def test_the_templates_own_tool_call_rendering_parses_back(name):
    tpl, fmt = template(name), fmt_of(name)
    user = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]}
    history = tpl.render(user, TOOLS, add_generation_prompt=False)
    full = tpl.render(user + [call], TOOLS, add_generation_prompt=False)
    assert full.startswith(history)
    turn = full[len(history):]  # the assistant turn as the template renders it: header, then the call syntax
    if fmt.name == "harmony":  # the generation prompt ends with the role; the recipient may follow it
        reply = turn[turn.find("<|start|>assistant") + len("<|start|>assistant"):]
    else:
        reply = turn[min(i for i in (turn.find(m) for m in fmt.call_starts) if i >= 0):]
    reply = reply[: min((reply.find(e) for e in EOT if e in reply), default=len(reply))]
    opens = False
    out = parse_output(reply, opens, True, fmt)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == \
        [("get_weather", ARGS)], reply
    assert out.content == ""


# (template, generated text, prompt opened reasoning, reasoning, content, [(name, arguments)])
CASES = [
    ("Qwen3.5-4B", "Check.\n</think>\n\nOn it.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", True, "Check.", "On it.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("Qwen-Qwen3-0.6B", "<think>\nhm\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
     False, "hm", "", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("ibm-granite-granite-4.0", "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}"
     "\n</tool_call>", False, None, "Sure.", [("get_weather", {"city": "Rome"})]),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "Need data.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
     "function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Lima\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     True, "Need data.", "", [("get_weather", {"city": "Lima"})]),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "Easy.\n</think>\n\nIt is 4.", True, "Easy.", "It is 4.", []),
    ("mistralai-Mistral-Nemo-Instruct-2407", "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"Bern\"}, \"id\": \"a1b2c3d4e\"}]", False, None, "", [("get_weather", {"city": "Bern"})]),
    ("mistralai-Mistral-Nemo-Instruct-2407", "No tools needed [TOOL_CALLS] broken", False, None,
     "No tools needed [TOOL_CALLS] broken", []),
    ("NVIDIA-Nemotron-Nano-v2", "<think>\nplan\n</think>\nCalling.\n<TOOLCALL>[{\"name\": \"get_weather\", "
     "\"arguments\": {\"city\": \"Kyiv\"}}]</TOOLCALL>", False, "plan", "Calling.", [("get_weather", {"city": "Kyiv"})]),
    ("LFM2.5-Instruct", "<think>\nok\n</think>\n<|tool_call_start|>[get_weather(city=\"Oslo\", days=2, metric=true), "
     "get_time(zone='CET')]<|tool_call_end|>", False, "ok", "",
     [("get_weather", {"city": "Oslo", "days": 2, "metric": True}), ("get_time", {"zone": "CET"})]),
    ("meta-llama-Llama-3.1-8B-Instruct", "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Cairo\"}}", False,
     None, "", [("get_weather", {"city": "Cairo"})]),
    ("meta-llama-Llama-3.1-8B-Instruct", "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Quito\"}}",
     False, None, "", [("get_weather", {"city": "Quito"})]),
    ("meta-llama-Llama-3.1-8B-Instruct", "Paris is sunny; {\"name\" is a key}", False, None,
     "Paris is sunny; {\"name\" is a key}", []),
    ("HuggingFaceTB-SmolLM3-3B", "<think>\nx\n</think>\nHello.", False, "x", "Hello.", []),
    ("google-gemma-2-2b-it", "<think> is not a tag here", False, None, "<think> is not a tag here", []),
    ("openai-gpt-oss-120b", "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
     "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}", False,
     "Need weather.", "", [("get_weather", {"city": "Paris"})]),
    ("openai-gpt-oss-120b", "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Hello there.", False, "Simple.", "Hello there.", []),
    ("openai-gpt-oss-120b", " to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}",
     False, None, "", [("get_weather", {"city": "Oslo"})]),
    ("openai-gpt-oss-120b", "<|channel|>analysis<|message|>cut off while thi", False, "cut off while thi", "", []),
]


@pytest.mark.parametrize("name,text,opens,reasoning,content,calls", CASES)
def test_parse_output_per_family(name, text, opens, reasoning, content, calls):
    out = parse_output(text, opens, True, fmt_of(name))
    assert out.reasoning == reasoning
    assert out.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in out.tool_calls)


@pytest.mark.parametrize("name,text,opens,reasoning,content,calls", CASES)
def test_streamed_pieces_add_up_to_the_whole_parse(name, text, opens, reasoning, content, calls):
    rng = random.Random(len(text))
    for _ in range(20):
        p = make_stream_parser(opens, True, fmt_of(name))
        pieces, i = [], 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            pieces += p.push(text[i:j])
            i = j
        rest, got = p.finish()
        pieces += rest
        assert "".join(s for k, s in pieces if k == "reasoning") == (reasoning or "")
        assert "".join(s for k, s in pieces if k == "content") == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


def test_without_tools_in_the_request_tool_syntax_stays_content():
    text = "<tool_call>\n{\"name\": \"x\", \"arguments\": {}}\n</tool_call>"
    out = parse_output(text, False, False, fmt_of("Qwen-Qwen3-0.6B"))
    assert out.content == text and out.tool_calls == []


def test_gpt_oss_history_reasoning_is_passed_as_thinking():
    fmt, tpl = fmt_of("openai-gpt-oss-120b"), template("openai-gpt-oss-120b")
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me check.", "reasoning_content": "Call the tool.",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = tpl.render(fmt.template_messages(msgs), TOOLS, add_generation_prompt=True)
    assert "<|channel|>analysis<|message|>Call the tool.<|end|>" in text
    assert msgs[1]["reasoning_content"] == "Call the tool." and "thinking" not in msgs[1]  # input untouched
    qwen = fmt_of("Qwen3.5-4B")
    assert qwen.template_messages(msgs) is msgs
