"""What kind of request the verifier is asked to write, for `self-prompts --styles`.

An instruct model sampled with the user turn opened and empty writes the requests it was tuned on
most often (short questions). Real chat is broader: writing, roleplay, extraction from a pasted
text, system prompts that set a persona, second turns that follow up on an answer, requests
that carry constraints. Each style here is one way to make the verifier itself write such a
request, with nothing but its own weights (Magpie's task-specific system prompts; evol-style
rewrites done by the verifier):

- `open`: the plain Magpie prefix (the default system prompt, an empty user turn);
- `category`: a system prompt that says what users of this assistant ask (one of `CATEGORIES`),
  seen only while the request is written; a category may also open the user's turn (an
  instruction to summarise or extract, whose text the verifier then writes);
- `persona`: a system prompt from `PERSONAS` that stays in the served request;
- `followup`: a kept request, the verifier's greedy answer, and a second user turn;
- `rewrite`: the verifier rewrites a kept request to be more specific and harder.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

STYLES = ("open", "category", "persona", "followup", "rewrite")
DEFAULT_STYLES = "open:1,category:5,persona:1,followup:1,rewrite:1"


@dataclass(frozen=True)
class Category:
    name: str
    users_ask: str  # what the system prompt says users of this assistant ask for
    openers: tuple[str, ...] = ()  # user-turn starts whose text the verifier goes on to write


CATEGORIES = (
    Category("writing", "stories, poems, letters, speeches, product descriptions and essays, "
             "often with a required length, tone or form"),
    Category("roleplay", "to play a character, a historical figure or a job, or to act out a "
             "scenario such as an interview or a negotiation, and to stay in character"),
    Category("reasoning", "riddles, logic puzzles, brain teasers, comparisons and questions "
             "that need careful step-by-step thinking"),
    Category("math", "arithmetic, algebra, geometry, probability, statistics and word problems"),
    Category("coding", "to write, explain, debug, review or translate code in Python, "
             "JavaScript, SQL, C, Rust, shell and other languages"),
    Category("extraction", "to pull names, dates, numbers or facts out of a text they paste, or "
             "to turn it into a list, a table or JSON",
             ("Extract all the names and dates from the following text:\n\n",
              "Read the text below and list the key facts as bullet points.\n\n",
              "Turn the following information into a JSON object:\n\n")),
    Category("stem", "questions about physics, chemistry, biology, medicine, astronomy, "
             "computer science and engineering"),
    Category("humanities", "questions about history, philosophy, literature, art, music, "
             "economics, law and the social sciences"),
    Category("advice", "practical advice on careers, studying, relationships, health habits, "
             "travel, money and everyday decisions"),
    Category("editing", "to summarise, shorten, proofread, rephrase or change the tone of a "
             "paragraph they paste",
             ("Summarize the following text in two sentences:\n\n",
              "Proofread this paragraph and fix any mistakes:\n\n",
              "Rewrite this in a more formal tone:\n\n",
              "Make this paragraph shorter and clearer:\n\n")),
)
CATEGORY_NAMES = tuple(c.name for c in CATEGORIES)

# How detailed the request is told to be: half of the category requests carry constraints.
DETAIL = ("", "Their requests are detailed: several sentences, with constraints on length, "
              "format, audience or style.")

PERSONAS = (
    "You are a friendly customer support agent for an online bookstore.",
    "You are a patient tutor for high school students. Explain things simply.",
    "You are a concise assistant. Answer in at most three sentences.",
    "You are a senior software engineer who reviews code carefully.",
    "You are a travel agent who plans trips on a budget.",
    "You are a personal fitness coach.",
    "You are a helpful assistant that always answers with a numbered list.",
    "You are a chef who suggests recipes from whatever ingredients the user has.",
    "You are a career counsellor who helps people write resumes and prepare for interviews.",
    "You are a science communicator who explains research to the general public.",
    "You are a pirate captain. Speak like a pirate.",
    "You are a Socratic teacher: you answer questions with guiding questions.",
    "You are an assistant for a small business owner: marketing, accounting and planning.",
    "You are a history professor who tells vivid stories about the past.",
    "You are a helpful assistant. Reply in a formal, professional tone.",
    "You are a gardening expert.",
)

REWRITE_INSTRUCTION = ("Rewrite the following request so that it is more specific and more "
                       "challenging, adding one or two concrete constraints. Reply with the "
                       "rewritten request only.\n\nRequest: ")


def category_system_prompt(category: Category, detail: str) -> str:
    """The system prompt seen while the verifier writes a request of `category`."""
    return " ".join(filter(None, (
        f"You are a helpful AI assistant. Users ask you for {category.users_ask}.", detail)))


def parse_styles(spec: str) -> dict[str, float]:
    """`name:weight,...` (a bare name weighs 1) -> weights; unknown or negative ones are
    refused by name."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition(":")
        if name not in STYLES:
            raise ValueError(f"--styles: unknown style {name!r}; choose from {list(STYLES)}")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"--styles: weight of {name!r} is not a number: {weight!r}") from None
        if value < 0:
            raise ValueError(f"--styles: weight of {name!r} must be >= 0, got {value}")
        weights[name] = value
    if not any(weights.values()):
        raise ValueError(f"--styles {spec!r} gives no style a positive weight")
    return weights


@dataclass(frozen=True)
class RequestPlan:
    """One request to be written: its style, and what the verifier sees while writing it."""

    style: str
    category: str = ""
    writing_system: str = ""  # system prompt while the request is written ("" = the default)
    served_system: str = ""  # system prompt kept in the served request ("" = none)
    opener: str = ""  # the start of the user's turn; the request is opener + what follows


def draw_plan(rng: random.Random, style: str) -> RequestPlan:
    """A random plan of `style` (followup and rewrite plans get their request later)."""
    if style == "category":
        category = rng.choice(CATEGORIES)
        opener = rng.choice(category.openers) if category.openers and rng.random() < 0.7 else ""
        return RequestPlan(style, category.name,
                           category_system_prompt(category, rng.choice(DETAIL)), "", opener)
    if style == "persona":
        persona = rng.choice(PERSONAS)
        return RequestPlan(style, "persona", persona, persona)
    return RequestPlan(style, style if style != "open" else "open")
