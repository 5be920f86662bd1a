"""The official `openai` Python client against a running stoke-serve.

Usage: python openai_client.py BASE_URL MODEL

Completions and chat, streamed and not; stop strings; seeded sampling; log-probabilities;
usage against the server's tokenizer (`/tokenize`); errors as the client raises them; and 32
concurrent clients, each of which must get the greedy text it gets alone. Exits non-zero on the
first failed check.
"""

import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

BASE, MODEL = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=600)
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def tokenize(**body):
    req = urllib.request.Request(
        BASE + "/tokenize",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req) as r:
        return json.load(r)["count"]


PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]

# Models.
ids = [m.id for m in client.models.list().data]
check(ids == [MODEL], f"models: {ids}")

# Completions, whole.
c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
text = c.choices[0].text
check(len(text) > 0, "completion text is empty")
check(c.object == "text_completion", c.object)
check(c.usage.prompt_tokens == tokenize(prompt=PROMPT), f"prompt tokens {c.usage}")
fin = c.choices[0].finish_reason
check(fin in ("stop", "length"), fin)
if fin == "length":
    check(c.usage.completion_tokens == 12, f"completion tokens {c.usage}")
check(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens, "total")

# Completions, streamed: the same text, usage at the end.
pieces, usage, finish = [], None, None
for ch in client.completions.create(
    model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
    stream_options={"include_usage": True},
):
    if ch.usage is not None:
        usage = ch.usage
    for choice in ch.choices:
        pieces.append(choice.text)
        finish = choice.finish_reason or finish
check("".join(pieces) == text, f"streamed {''.join(pieces)!r} != {text!r}")
check(usage is not None and usage.completion_tokens == c.usage.completion_tokens, f"usage {usage}")
check(finish == fin, f"finish {finish}")

# Chat, whole and streamed.
r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
answer = r.choices[0].message.content
check(r.choices[0].message.role == "assistant", "role")
check(len(answer) > 0, "chat answer is empty")
check(r.usage.prompt_tokens == tokenize(messages=MESSAGES), f"chat prompt tokens {r.usage}")
streamed, roles = [], []
for ch in client.chat.completions.create(
    model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stream=True,
):
    for choice in ch.choices:
        if choice.delta.role:
            roles.append(choice.delta.role)
        if choice.delta.content:
            streamed.append(choice.delta.content)
check("".join(streamed) == answer, f"chat streamed {''.join(streamed)!r} != {answer!r}")
check(roles == ["assistant"], f"roles {roles}")
r2 = client.chat.completions.create(
    model=MODEL, messages=MESSAGES, max_completion_tokens=16, temperature=0)
check(r2.choices[0].message.content == answer, "max_completion_tokens")

# A stop string: the text ends before it.
words = text.split()
stop = " " + words[len(words) // 2]
s = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
check(s.choices[0].finish_reason == "stop", f"stop finish {s.choices[0].finish_reason}")
check(text.startswith(s.choices[0].text) and stop not in s.choices[0].text,
      f"stop {stop!r}: {s.choices[0].text!r} of {text!r}")

# Seeds: the same seed draws the same text; n choices differ from each other.
def sampled(seed, n=1):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                    top_p=0.95, seed=seed, n=n)
    return [ch.text for ch in sorted(out.choices, key=lambda ch: ch.index)]

a, b = sampled(1234), sampled(1234)
check(a == b, f"seeded {a} != {b}")
two = sampled(1234, n=2)
check(len(two) == 2 and two[0] == a[0], f"n=2 {two} (first should be {a})")

# Log-probabilities.
lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
l = lp.choices[0].logprobs
check(len(l.tokens) == lp.usage.completion_tokens == len(l.token_logprobs), f"logprobs {l}")
check(all(len(t) <= 2 and len(t) >= 1 for t in l.top_logprobs), "top logprobs")
check(all(x <= 0 for x in l.token_logprobs), "logprobs are <= 0")
cl = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                    logprobs=True, top_logprobs=3)
content = cl.choices[0].logprobs.content
check(len(content) == cl.usage.completion_tokens, "chat logprobs per token")
check(all(1 <= len(t.top_logprobs) <= 3 for t in content), "chat top logprobs")

# Errors, as the client raises them.
try:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=-1)
    check(False, "temperature -1 was accepted")
except openai.BadRequestError as e:
    check(e.status_code == 400 and e.body["param"] == "temperature", f"{e.body}")
try:
    client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    check(False, "an unknown model was accepted")
except openai.NotFoundError as e:
    check(e.status_code == 404, str(e))
try:
    client.completions.create(model=MODEL, prompt="x " * 5000, max_tokens=4)
    check(False, "a prompt over the context was accepted")
except openai.BadRequestError as e:
    check(e.body["code"] == "context_length_exceeded", f"{e.body}")
try:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, presence_penalty=0.5)
    check(False, "presence_penalty was accepted")
except openai.BadRequestError as e:
    check(e.body["param"] == "presence_penalty", f"{e.body}")

# 32 concurrent clients: each gets the greedy text it gets alone.
prompts = ["Once upon a time", "The best way to learn", "In 1969, the", "My favourite food is"]

def greedy(p):
    return client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text

alone = {p: greedy(p) for p in prompts}
with ThreadPoolExecutor(32) as pool:
    together = list(pool.map(greedy, [prompts[i % 4] for i in range(32)]))
for i, t in enumerate(together):
    check(t == alone[prompts[i % 4]], f"client {i}: {t!r} != alone {alone[prompts[i % 4]]!r}")

print(f"openai client {openai.__version__}: {checks} checks passed")
