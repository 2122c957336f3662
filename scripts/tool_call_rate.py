"""How often the served Thinker calls a tool, and with the right arguments.

Usage: python3 scripts/tool_call_rate.py URL [RUNS] [auto|forced]. Asks RUNS
questions that need the offered tool (a real server, Chat Completions),
sampled at the profile's temperature, with tool_choice "auto" (the model
decides) or forced to the function, and counts the answers that call it and
those whose arguments name the asked city.
"""

import json
import sys
import urllib.request

URL = sys.argv[1].rstrip("/")
RUNS = int(sys.argv[2]) if len(sys.argv) > 2 else 12
FORCED = len(sys.argv) > 3 and sys.argv[3] == "forced"
CITIES = ["Paris", "Rome", "Tokyo", "Lima", "Oslo", "Cairo", "Berlin", "Madrid", "Seoul", "Boston", "Delhi", "Quito"]
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

calls = valid = errors = 0
for i in range(RUNS):
    city = CITIES[i % len(CITIES)]
    body = {"model": "x", "max_tokens": 60, "tools": [TOOL],
            "messages": [{"role": "user", "content": f"What is the weather in {city} right now?"}]}
    if FORCED:
        body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    req = urllib.request.Request(URL + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        m = json.load(urllib.request.urlopen(req))["choices"][0]["message"]
    except urllib.error.HTTPError as e:
        errors += 1
        print(city, "error", e.read()[:160].decode())
        continue
    tc = m.get("tool_calls") or []
    if tc:
        calls += 1
        args = json.loads(tc[0]["function"]["arguments"])
        valid += args.get("city") == city
    print(city, "call" if tc else "words", json.dumps(tc[0]["function"] if tc else m["content"])[:100])
print(f"{RUNS} runs, tool_choice {'forced' if FORCED else 'auto'}: {calls} called the tool, {valid} with the right city, {errors} invalid calls")
