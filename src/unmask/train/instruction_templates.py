"""Templated instruction records that need no corpus file: tool-use conversations with six synthetic tools
(call only, call + result + answer, or no call needed) and field extraction into one JSON object.

Pools of names, cities and items are small and fixed; every record is a pure function of the random stream it
is given. `instructions.build_instructions` assigns them to a split by a hash of their user prompt.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

Record = dict[str, Any]


def user_turn(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant_turn(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


_CITIES = ["Paris", "Lyon", "Berlin", "Madrid", "Lisbon", "Rome", "Oslo", "Tokyo", "Osaka",
           "Seoul", "Nairobi", "Cairo", "Lagos", "Lima", "Quito", "Toronto", "Denver", "Boston",
           "Austin", "Sydney", "Perth", "Dublin", "Vienna", "Prague", "Warsaw", "Athens",
           "Istanbul", "Mumbai", "Delhi", "Hanoi", "Jakarta", "Manila", "Santiago", "Bogota",
           "Havana", "Reykjavik", "Helsinki", "Zurich", "Geneva", "Montreal"]
_TIMEZONES = ["Europe/Paris", "Europe/London", "America/New_York", "America/Chicago",
              "America/Los_Angeles", "Asia/Tokyo", "Asia/Kolkata", "Australia/Sydney", "UTC",
              "Africa/Nairobi", "America/Sao_Paulo", "Asia/Singapore"]
_CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "INR", "BRL", "SEK"]
_CONDITIONS = ["sunny", "cloudy", "rainy", "foggy", "windy", "snowy", "partly cloudy"]
_FIRST = ["Alice", "Bob", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal",
          "Keiko", "Liam", "Maria", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sven", "Tara",
          "Umar", "Vera", "Wei", "Yara", "Zoe"]
_LAST = ["Smith", "Garcia", "Martin", "Kowalski", "Nguyen", "Okafor", "Rossi", "Schmidt",
         "Tanaka", "Silva", "Dubois", "Novak", "Haddad", "Larsen", "Moreau", "Patel", "Kim"]
_JOBS = ["nurse", "teacher", "carpenter", "software engineer", "baker", "pilot", "chemist",
         "librarian", "plumber", "architect", "journalist", "farmer", "dentist", "translator"]
_ITEMS = ["notebook", "pencil", "mug", "lamp", "chair", "backpack", "keyboard", "umbrella",
          "towel", "candle", "plate", "bottle"]
_ADJ = ["Silent", "Hidden", "Last", "Broken", "Golden", "Distant", "Quiet", "Burning", "Lost"]
_NOUN = ["River", "Garden", "Harbor", "Mountain", "Letter", "Bridge", "Winter", "Orchard", "Clock"]
_EVENTS = ["PyCon meetup", "book fair", "jazz festival", "science fair", "charity run",
           "board game night", "film screening", "hackathon"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December"]
_TASKS = ["call the dentist", "water the plants", "submit the report", "buy milk",
          "back up my laptop", "renew my passport", "pay the electricity bill"]

_TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {"description": "Get the current weather for a city.", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}},
    "search_docs": {"description": "Search the Python documentation.", "parameters": {
        "type": "object", "properties": {
            "query": {"type": "string"},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"]}},
    "run_python": {"description": "Run a Python snippet and return its standard output.",
                   "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                  "required": ["code"]}},
    "get_time": {"description": "Get the current local time in an IANA time zone.",
                 "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                                "required": ["timezone"]}},
    "convert_currency": {"description": "Convert an amount of money between currencies.",
                         "parameters": {"type": "object", "properties": {
                             "amount": {"type": "number"},
                             "from_currency": {"type": "string", "enum": _CURRENCIES},
                             "to_currency": {"type": "string", "enum": _CURRENCIES}},
                             "required": ["amount", "from_currency", "to_currency"]}},
    "create_reminder": {"description": "Create a reminder.", "parameters": {
        "type": "object", "properties": {
            "text": {"type": "string"},
            "time": {"type": "string", "description": "24h time, HH:MM"}},
        "required": ["text", "time"]}},
}


def tool_spec(name: str) -> dict[str, Any]:
    """OpenAI-style tool entry for one synthetic tool."""
    return {"type": "function", "function": {"name": name, **_TOOLS[name]}}


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class _Scenario:
    user: str
    calls: list[dict[str, Any]]
    results: list[Any]
    final: str


def _weather(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    cities = rng.sample(_CITIES, rng.choice([1, 1, 1, 2]))
    unit = rng.choice(["celsius", "celsius", "fahrenheit"])
    sym = "°C" if unit == "celsius" else "°F"
    calls, results, parts = [], [], []
    for city in cities:
        args = {"city": city} if unit == "celsius" else {"city": city, "unit": unit}
        temp = rng.randint(-5, 35) if unit == "celsius" else rng.randint(25, 95)
        cond = rng.choice(_CONDITIONS)
        calls.append(_call("get_weather", args))
        results.append({"city": city, "temperature": temp, "unit": unit, "condition": cond})
        parts.append(f"{city}: {temp}{sym}, {cond}")
    if len(cities) == 2:
        user = rng.choice(["Compare the weather in {a} and {b}.",
                           "What's the weather in {a} and in {b}?"]).format(a=cities[0], b=cities[1])
    else:
        user = rng.choice(["What's the weather like in {a}?", "Is it cold in {a} right now?",
                           "Weather in {a} please.", "How warm is it in {a} today?"]
                          ).format(a=cities[0])
    if unit == "fahrenheit":
        user = user.rstrip(".?") + " (in Fahrenheit)?"
    return _Scenario(user, calls, results, "Current weather: " + "; ".join(parts) + ".")


def _search(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    name, summary = rng.choice(facts) if facts else ("json", "JSON encoder and decoder.")
    k = rng.randint(1, 5)
    user = rng.choice(["Search the docs for `{n}`.", "Look up `{n}` in the Python documentation.",
                       "Can you find documentation about `{n}`?"]).format(n=name)
    args: dict[str, Any] = {"query": name} if rng.random() < 0.5 else {"query": name, "max_results": k}
    result = [{"title": name, "summary": summary}]
    return _Scenario(user, [_call("search_docs", args)], [result], f"`{name}`: {summary}")


def _python(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    kind = rng.randrange(3)
    if kind == 0:
        a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(0, 999)
        code, value = f"print({a} * {b} + {c})", str(a * b + c)
        user = f"Use Python to compute {a} * {b} + {c}."
    elif kind == 1:
        xs = [rng.randint(-50, 99) for _ in range(rng.randint(3, 8))]
        code, value = f"print(sorted({xs}))", str(sorted(xs))
        user = f"Sort {xs} with Python."
    else:
        word = rng.choice(_NOUN).lower() + rng.choice(_ITEMS)
        code, value = f"print(len({word!r}))", str(len(word))
        user = f"Run Python to count the characters in {word!r}."
    return _Scenario(user, [_call("run_python", {"code": code})], [{"stdout": value + "\n"}],
                     f"The output is {value}.")


def _time(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    tz = rng.choice(_TIMEZONES)
    hhmm = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    user = rng.choice(["What time is it in {t}?", "Current time in {t}?",
                       "Tell me the local time for {t}."]).format(t=tz)
    return _Scenario(user, [_call("get_time", {"timezone": tz})], [{"timezone": tz, "time": hhmm}],
                     f"It is {hhmm} in {tz}.")


def _currency(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    src, dst = rng.sample(_CURRENCIES, 2)
    amount = rng.choice([5, 10, 20, 50, 75, 100, 250, 1000, 12.5, 99.99])
    converted = round(amount * rng.uniform(0.5, 1.6), 2)
    user = rng.choice(["How much is {a} {s} in {d}?", "Convert {a} {s} to {d}.",
                       "I have {a} {s}. What is that in {d}?"]).format(a=amount, s=src, d=dst)
    args = {"amount": amount, "from_currency": src, "to_currency": dst}
    return _Scenario(user, [_call("convert_currency", args)],
                     [{"amount": converted, "currency": dst}],
                     f"{amount} {src} is about {converted} {dst}.")


def _reminder(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    task, hhmm = rng.choice(_TASKS), f"{rng.randint(6, 22):02d}:{rng.choice(['00', '15', '30', '45'])}"
    user = rng.choice(["Remind me to {x} at {t}.", "Set a reminder at {t} to {x}."]).format(x=task, t=hhmm)
    return _Scenario(user, [_call("create_reminder", {"text": task, "time": hhmm})],
                     [{"status": "ok", "id": rng.randint(1, 9999)}],
                     f"Done. I will remind you to {task} at {hhmm}.")


_SCENARIOS = {"get_weather": _weather, "search_docs": _search, "run_python": _python,
              "get_time": _time, "convert_currency": _currency, "create_reminder": _reminder}


def tool_call_record(rng: random.Random, facts: list[tuple[str, str]]) -> Record:
    """One tool-use conversation: call only (55%), call + result + answer (35%), or no call."""
    mode = rng.random()
    if mode < 0.1 and facts:
        # Tools are offered but not needed: answer directly.
        name, summary = rng.choice(facts)
        tools = rng.sample([t for t in _TOOLS if t != "search_docs"], rng.randint(1, 3))
        messages = [user_turn(f"Without using any tool: what does `{name}` do?"), assistant_turn(summary)]
    else:
        tool = rng.choice(sorted(_SCENARIOS))
        s = _SCENARIOS[tool](rng, facts)
        # at most two other tools: with three, 18% of conversations outgrew 512-token rows
        others = rng.sample([t for t in _TOOLS if t != tool], rng.randint(0, 2))
        tools = others + [tool]
        rng.shuffle(tools)
        messages = [user_turn(s.user), {"role": "assistant", "content": "", "tool_calls": s.calls}]
        if mode >= 0.65:
            messages += [{"role": "tool", "name": c["function"]["name"],
                          "content": json.dumps(r, ensure_ascii=False)}
                         for c, r in zip(s.calls, s.results)]
            messages.append(assistant_turn(s.final))
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
    return {"kind": "tool_call", "tools": [tool_spec(t) for t in tools], "messages": messages}


def _person(rng: random.Random) -> tuple[str, dict[str, Any]]:
    name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    age, job = rng.randint(19, 80), rng.choice(_JOBS)
    city = rng.choice(_CITIES) if rng.random() < 0.8 else None
    if city is None:
        text = rng.choice(["{n} is a {a}-year-old {j}.", "{n}, {a}, works as a {j}."])
    else:
        text = rng.choice(["{n} is a {a}-year-old {j} living in {c}.",
                           "Meet {n}: {a} years old, works as a {j} in {c}.",
                           "{n} moved to {c} last year; the {a}-year-old is a {j}."])
    return text.format(n=name, a=age, j=job, c=city), {"name": name, "age": age, "city": city,
                                                        "occupation": job}


def _order(rng: random.Random) -> tuple[str, dict[str, Any]]:
    item, qty = rng.choice(_ITEMS), rng.randint(1, 12)
    price, cur = round(rng.uniform(1, 80), 2), rng.choice(_CURRENCIES[:4])
    text = rng.choice(["I'd like to order {q} {i}s at {p} {c} each.",
                       "Please send {q} x {i} ({p} {c} per unit).",
                       "Order: {i}, quantity {q}, unit price {p} {c}."]).format(q=qty, i=item, p=price, c=cur)
    return text, {"item": item, "quantity": qty, "unit_price": price, "currency": cur}


def _event(rng: random.Random) -> tuple[str, dict[str, Any]]:
    title, city = rng.choice(_EVENTS), rng.choice(_CITIES)
    year, month, day = rng.randint(2020, 2030), rng.randint(1, 12), rng.randint(1, 28)
    text = rng.choice(["The {t} will take place in {c} on {m} {d}, {y}.",
                       "Join us on {m} {d}, {y} for the {t} in {c}!"]
                      ).format(t=title, c=city, m=_MONTHS[month - 1], d=day, y=year)
    return text, {"event": title, "city": city, "date": f"{year:04d}-{month:02d}-{day:02d}"}


def _book(rng: random.Random) -> tuple[str, dict[str, Any]]:
    title = f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)}"
    author, year = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", rng.randint(1850, 2024)
    text = rng.choice(["'{t}' was written by {a} and published in {y}.",
                       "{a} published {t} in {y}.", "In {y}, {a} released the novel \"{t}\"."]
                      ).format(t=title, a=author, y=year)
    return text, {"title": title, "author": author, "year": year}


_JSON_KINDS = [_person, _order, _event, _book]


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number"}.get(type(value), "string")


def json_record(rng: random.Random, facts: list[tuple[str, str]]) -> Record:
    """Extract fields from a sentence; the answer is exactly one JSON object."""
    text, obj = rng.choice(_JSON_KINDS)(rng)
    keys = list(obj)
    if rng.random() < 0.5:
        prompt = (f"Extract {', '.join(keys[:-1])} and {keys[-1]} from the text as a JSON object "
                  f"(use null for anything missing). Answer with JSON only.\n\nText: {text}")
    else:
        schema = {"type": "object", "required": keys, "properties": {
            k: {"type": [_json_type(v), "null"]} if v is None or k == "city" else {"type": _json_type(v)}
            for k, v in obj.items()}}
        if "date" in obj:
            schema["properties"]["date"]["format"] = "date"
        prompt = (f"Return a JSON object matching this schema:\n{json.dumps(schema)}\n\n"
                  f"Text: {text}")
    return {"kind": "json", "messages": [user_turn(prompt), assistant_turn(json.dumps(obj, ensure_ascii=False))]}
