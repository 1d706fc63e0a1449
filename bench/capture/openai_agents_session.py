"""Two turns of an OpenAI Agents SDK agent (its default model: the Responses API) with one function tool, against
the server at URL (e.g. http://127.0.0.1:PORT/v1):  python bench/capture/openai_agents_session.py URL"""
import asyncio, sys
from openai import AsyncOpenAI
from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled

@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny in {city}."

async def main(url):
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=url, api_key="dummy"), use_for_tracing=False)
    agent = Agent(name="Assistant", instructions="You are a helpful assistant.", tools=[get_weather])
    r1 = await Runner.run(agent, "What is the weather in Paris?")
    print("turn1:", r1.final_output)
    r2 = await Runner.run(agent, r1.to_input_list() + [{"role": "user", "content": "And tomorrow?"}])
    print("turn2:", r2.final_output)

asyncio.run(main(sys.argv[1]))
