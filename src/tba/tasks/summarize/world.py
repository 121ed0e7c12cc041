"""The embedded summarisation world: short posts, careless reference summaries, and the gold
judge that defines what a good summary is. Everything is synthetic and harmless.

- **Posts** have five short sentences: 2 to 4 *key events* among distractors, e.g.

      post : it was windy . ana lost kite . ben saw lamp . cleo fixed drum . park was busy .
      tl;dr :

  A key event is `<name> <key action> <object>`; a distractor is a minor event
  (`<name> <minor action> <object>`) or chatter about the weather or a place. Every person in a
  post has a name of their own.
- **The ideal summary** states each key event as `<name> <action> <object>`, in the post's
  order, joined by `and`: `ana lost kite and cleo fixed drum`.
- **Reference summaries** come from a careless annotator: most of them leave out the last key
  event (`DROP_PROB`), some replace the object of one event with another object of the post
  (`SWAP_PROB`), and some end with idle words (`PAD_PROB`). A policy imitating them keeps their
  habits; a better summary beats them.
- **The gold judge** reads the events a summary states (every `<name> <action> <object>` run of
  words) and scores

      gold(s) = recalled - invented - 0.5 * repeated - 0.25 * max(0, words - budget)

  recalled: distinct key events stated; invented: distinct events stated that are not key events
  (made up, altered, or minor); repeated: statements of an event already stated; words: the
  summary's length in words; budget: 4 words per key event (the ideal summary has one fewer).
  A summary *wins* against the reference when its gold score is higher; a tie counts half.

Posts are a fixed function of their split (`sft`, `preference`, `train`, `test`): the world is
the task, the same for every run seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VERSION = 1  # bump when the world changes: it keys the cached models

NAMES = ["ana", "ben", "cleo", "dev", "eli", "fay", "gus", "hana", "ivo", "june", "kai", "lena"]
KEY_ACTIONS = ["lost", "found", "broke", "fixed", "sold", "bought", "won", "painted"]
MINOR_ACTIONS = ["saw", "liked", "wanted", "mentioned", "noticed", "admired"]
OBJECTS = ["kite", "bike", "lamp", "book", "drum", "boat", "clock", "scarf", "piano", "tent",
           "map", "vase"]  # fmt: skip
PLACES = ["park", "lake", "market", "school", "harbor", "library", "garden", "station"]
WEATHER = ["sunny", "windy", "rainy", "cold", "warm"]
MOODS = ["busy", "quiet", "crowded", "empty"]
PADDING = ["so yeah", "so that was all", "anyway that was the day", "and so on"]
FILLERS = ["post", ":", "tl;dr", ".", "and", "it", "was"]
SENTENCES = 5  # per post

DROP_PROB = 0.7  # the reference leaves out the last key event
SWAP_PROB = 0.15  # the reference gives one key event another object of the post
PAD_PROB = 0.3  # the reference ends with idle words
WORDS_PER_EVENT = 4  # the length budget: `<name> <action> <object> and`
MAX_SUMMARY_WORDS = 24  # room for the longest careless reference (20 words), and then some

Event = tuple[str, str, str]  # (name, action, object)


def vocabulary() -> list[str]:
    """Every word of the world (the tokenizer's vocabulary, before special tokens)."""
    words = NAMES + KEY_ACTIONS + MINOR_ACTIONS + OBJECTS + PLACES + WEATHER + MOODS + FILLERS
    words += [w for phrase in PADDING for w in phrase.split()]
    return sorted(set(words))


@dataclass(frozen=True)
class Post:
    # "post : ... tl;dr : ", the policy's prompt; its last space lets prompt + summary be joined
    # as text, as a reward model reads them
    prompt: str
    events: tuple[Event, ...]  # the key events, in the post's order
    reference: str  # the careless annotator's summary


def render_events(events: list[Event] | tuple[Event, ...]) -> str:
    return " and ".join(f"{name} {action} {obj}" for name, action, obj in events)


def ideal_summary(post: Post) -> str:
    return render_events(post.events)


def make_post(rng: random.Random) -> Post:
    """A post of `SENTENCES` sentences, 2 to 4 of them key events, and its reference."""
    count = rng.randint(2, 4)
    names = rng.sample(NAMES, SENTENCES)
    events = [(name, rng.choice(KEY_ACTIONS), rng.choice(OBJECTS)) for name in names[:count]]
    key = [f"{name} {action} {obj} ." for name, action, obj in events]
    sentences = [_distractor(rng, name) for name in names[count:]]  # the other sentences
    # The key events go to random places among the distractors, in their own order.
    for slot, sentence in zip(sorted(rng.sample(range(len(key) + len(sentences)), len(key))), key):
        sentences.insert(slot, sentence)
    prompt = "post : " + " ".join(sentences) + " tl;dr : "
    objects = [w for s in sentences for w in s.split() if w in OBJECTS]
    return Post(prompt, tuple(events), careless_summary(rng, events, objects))


def _distractor(rng: random.Random, name: str) -> str:
    kind = rng.random()
    if kind < 0.5:
        return f"{name} {rng.choice(MINOR_ACTIONS)} {rng.choice(OBJECTS)} ."
    if kind < 0.75:
        return f"it was {rng.choice(WEATHER)} ."
    return f"{rng.choice(PLACES)} was {rng.choice(MOODS)} ."


def careless_summary(rng: random.Random, events: list[Event], objects: list[str]) -> str:
    """The ideal summary with the annotator's habits: drop the last event, swap an object, pad."""
    stated = list(events)
    if rng.random() < DROP_PROB:
        stated = stated[:-1]
    if rng.random() < SWAP_PROB:
        i = rng.randrange(len(stated))
        name, action, obj = stated[i]
        others = [o for o in objects if o != obj] or [o for o in OBJECTS if o != obj]
        stated[i] = (name, action, rng.choice(others))
    text = render_events(stated)
    if rng.random() < PAD_PROB:
        text += " " + rng.choice(PADDING)
    return text


def posts(split: str, count: int) -> list[Post]:
    """The first `count` posts of a split (`sft`, `preference`, `train`, `test`)."""
    rng = random.Random(f"summarize-v{VERSION}/{split}")
    return [make_post(rng) for _ in range(count)]


# ------------------------------------------------------------------------------ the gold judge


def key_events(prompt: str) -> list[Event]:
    """The key events of a post, read from its text: `<name> <key action> <object>`."""
    words = prompt.split()
    return [(words[i - 1], words[i], words[i + 1]) for i in range(1, len(words) - 1)
            if words[i] in KEY_ACTIONS]  # fmt: skip


def stated_events(summary: str) -> list[Event]:
    """Every `<name> <action> <object>` run of words in a summary, in order."""
    words = summary.split()
    events, i = [], 0
    actions = set(KEY_ACTIONS) | set(MINOR_ACTIONS)
    while i + 2 < len(words):
        name, action, obj = words[i : i + 3]
        if name in NAMES and action in actions and obj in OBJECTS:
            events.append((name, action, obj))
            i += 3
        else:
            i += 1
    return events


@dataclass(frozen=True)
class Verdict:
    recalled: int
    invented: int
    repeated: int
    excess_words: int

    @property
    def score(self) -> float:
        return self.recalled - self.invented - 0.5 * self.repeated - 0.25 * self.excess_words


def judge(prompt: str, summary: str) -> Verdict:
    """The gold judge's reading of a summary of the post `prompt` (see the module docstring)."""
    key = set(key_events(prompt))
    stated = stated_events(summary)
    distinct = set(stated)
    budget = WORDS_PER_EVENT * len(key)
    return Verdict(
        recalled=len(distinct & key),
        invented=len(distinct - key),
        repeated=len(stated) - len(distinct),
        excess_words=max(0, len(summary.split()) - budget),
    )


def gold_scores(prompts: list[str], summaries: list[str]) -> list[float]:
    return [judge(p, s).score for p, s in zip(prompts, summaries)]
