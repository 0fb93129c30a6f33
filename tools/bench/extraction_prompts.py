"""Extraction prompts with pydantic models and known answers, as an application sends them through the
``openai`` client's ``chat.completions.parse(response_format=Model)`` (strict json_schema): the real-model
tests' (tests/vllm_engine/test_real_model.py, PROMPTS), ``maskd bench vllm --drafts``'s ``extraction``
workload (PROMPTS) and ``maskd bench vllm --quality``'s fixed set (QUALITY_SET: every text of PROMPTS and
MORE_PROMPTS with its answer, 56 cases: names, numbers, enums, nested objects, bounded lists, booleans,
dates as strings).

Each prompt has more texts of the same kind (``more``, each with its answer): the bench's later
requests of a schema, whose grammar drafts can use what the schema's earlier requests wrote."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from pydantic import BaseModel, Field

from maskd_tools.demo import is_right as answer_is_right


class Person(BaseModel):
    name: str
    age: int


class City(BaseModel):
    city: str
    country: str


class Sentiment(str, enum.Enum):
    positive = "positive"
    negative = "negative"
    neutral = "neutral"


class Review(BaseModel):
    product: str
    sentiment: Sentiment


class Address(BaseModel):
    street: str
    city: str


class Contact(BaseModel):
    name: str
    email: str
    address: Address


class Meeting(BaseModel):
    title: str
    day: str
    attendees: list[str] = Field(max_length=4)


class Order(BaseModel):
    item: str
    quantity: int
    paid: bool


class Book(BaseModel):
    title: str
    author: str
    year: int


class Flight(BaseModel):
    origin: str
    destination: str
    passengers: int


class Event(BaseModel):
    event: str
    date: str = Field(pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")


class Product(BaseModel):
    name: str
    price: float
    in_stock: bool


class Shipment(BaseModel):
    tracking: str
    weight_kg: float
    destination: Address


class Department(str, enum.Enum):
    engineering = "engineering"
    sales = "sales"
    marketing = "marketing"
    support = "support"


class Employee(BaseModel):
    name: str
    department: Department


class Recipe(BaseModel):
    dish: str
    ingredients: list[str] = Field(min_length=1, max_length=5)
    minutes: int


class Condition(str, enum.Enum):
    sunny = "sunny"
    cloudy = "cloudy"
    rainy = "rainy"
    snowy = "snowy"


class Forecast(BaseModel):
    city: str
    temperature_c: int
    condition: Condition
    windy: bool


@dataclasses.dataclass(frozen=True)
class Extraction:
    name: str
    model: type[BaseModel]
    text: str
    answer: dict[str, Any]       # the fields a right answer has (compared case-insensitively)
    more: tuple[tuple[str, dict[str, Any]], ...] = ()   # more (text, answer) for the same model

    def texts(self) -> tuple[str, ...]:
        return (self.text, *(text for text, _ in self.more))

    def cases(self) -> tuple[tuple[str, dict[str, Any]], ...]:
        """Every (text, answer) of this prompt, its own first."""
        return ((self.text, self.answer), *self.more)


PROMPTS: tuple[Extraction, ...] = (
    Extraction("person", Person, "Alice is 31 years old.", {"name": "Alice", "age": 31},
               (("Bob is 45 years old.", {"name": "Bob", "age": 45}),
                ("Carla, aged 27, joined the team.", {"name": "Carla", "age": 27}),
                ("My grandfather Hugo turned 88 today.", {"name": "Hugo", "age": 88}))),
    Extraction("city", City, "I flew to Lyon, a city in France, last spring.", {"city": "Lyon", "country": "France"},
               (("We moved to Osaka in Japan.", {"city": "Osaka", "country": "Japan"}),
                ("The conference is in Porto, Portugal.", {"city": "Porto", "country": "Portugal"}),
                ("She was born in Quebec, a city in Canada.", {"city": "Quebec", "country": "Canada"}))),
    Extraction("review", Review, "The Zephyr headphones broke after two days. Terrible.",
               {"product": "Zephyr headphones", "sentiment": "negative"},
               (("I love the Aurora lamp, it lights the whole room.",
                 {"product": "Aurora lamp", "sentiment": "positive"}),
                ("The Nimbus kettle works. Nothing special.", {"product": "Nimbus kettle", "sentiment": "neutral"}),
                ("The Vega backpack is comfortable and sturdy, a great buy.",
                 {"product": "Vega backpack", "sentiment": "positive"}))),
    Extraction("contact", Contact, "Write to Bob Stone at bob@stone.org, 12 Elm Street, Boston.",
               {"name": "Bob Stone", "email": "bob@stone.org",
                "address": {"street": "12 Elm Street", "city": "Boston"}},
               (("Contact Dana Cruz: dana@cruz.io, 4 Oak Road, Denver.",
                 {"name": "Dana Cruz", "email": "dana@cruz.io", "address": {"street": "4 Oak Road", "city": "Denver"}}),
                ("Reach Eli Park at eli.park@mail.com, 77 Pine Avenue, Austin.",
                 {"name": "Eli Park", "email": "eli.park@mail.com",
                  "address": {"street": "77 Pine Avenue", "city": "Austin"}}),
                ("Send it to Fay Lin, fay@lin.net, 9 Lake Drive, Seattle.",
                 {"name": "Fay Lin", "email": "fay@lin.net",
                  "address": {"street": "9 Lake Drive", "city": "Seattle"}}))),
    Extraction("meeting", Meeting, "Budget review on Monday with Ann, Raj and Li.",
               {"title": "Budget review", "day": "Monday", "attendees": ["Ann", "Raj", "Li"]},
               (("Design sync on Tuesday with Omar and Kate.",
                 {"title": "Design sync", "day": "Tuesday", "attendees": ["Omar", "Kate"]}),
                ("Quarterly planning on Friday with Sam, Ivy and Noah.",
                 {"title": "Quarterly planning", "day": "Friday", "attendees": ["Sam", "Ivy", "Noah"]}),
                ("Hiring review on Wednesday with Leo.",
                 {"title": "Hiring review", "day": "Wednesday", "attendees": ["Leo"]}))),
    Extraction("order", Order, "Order: 3 blue mugs, already paid.", {"item": "blue mugs", "quantity": 3, "paid": True},
               (("Order: 2 red chairs, not paid yet.", {"item": "red chairs", "quantity": 2, "paid": False}),
                ("Order: 10 notebooks, paid by card.", {"item": "notebooks", "quantity": 10, "paid": True}),
                ("Order: 1 desk lamp, payment pending.", {"item": "desk lamp", "quantity": 1, "paid": False}))),
    Extraction("book", Book, "Dune, written by Frank Herbert, came out in 1965.",
               {"title": "Dune", "author": "Frank Herbert", "year": 1965},
               (("Emma, by Jane Austen, was published in 1815.",
                 {"title": "Emma", "author": "Jane Austen", "year": 1815}),
                ("The Hobbit by J. R. R. Tolkien appeared in 1937.",
                 {"title": "The Hobbit", "author": "J. R. R. Tolkien", "year": 1937}),
                ("Neuromancer, a 1984 novel by William Gibson.",
                 {"title": "Neuromancer", "author": "William Gibson", "year": 1984}))),
    Extraction("flight", Flight, "Book 2 seats from Paris to Rome.",
               {"origin": "Paris", "destination": "Rome", "passengers": 2},
               (("Book 5 seats from Berlin to Madrid.",
                 {"origin": "Berlin", "destination": "Madrid", "passengers": 5}),
                ("One ticket from Tokyo to Seoul, please.",
                 {"origin": "Tokyo", "destination": "Seoul", "passengers": 1}),
                ("We need 3 seats from Cairo to Athens.",
                 {"origin": "Cairo", "destination": "Athens", "passengers": 3}))),
)

# The quality set's other schemas (not in the real-model tests nor the drafts workload).
MORE_PROMPTS: tuple[Extraction, ...] = (
    Extraction("event", Event, "The Spring Fair takes place on 2024-04-12.",
               {"event": "Spring Fair", "date": "2024-04-12"},
               (("Jazz Night is on 2024-11-08.", {"event": "Jazz Night", "date": "2024-11-08"}),
                ("The Harvest Market opens 2025-09-20.", {"event": "Harvest Market", "date": "2025-09-20"}),
                ("The Product Launch happens on March 3, 2025.", {"event": "Product Launch", "date": "2025-03-03"}))),
    Extraction("product", Product, "The Orion desk costs 249.99 dollars and is in stock.",
               {"name": "Orion desk", "price": 249.99, "in_stock": True},
               (("The Luma mouse, 19.5 dollars, is sold out.",
                 {"name": "Luma mouse", "price": 19.5, "in_stock": False}),
                ("Kappa chair: 89 dollars, available now.", {"name": "Kappa chair", "price": 89, "in_stock": True}),
                ("The Terra tent costs 120 dollars but is out of stock.",
                 {"name": "Terra tent", "price": 120, "in_stock": False}))),
    Extraction("shipment", Shipment, "Parcel ZX-4471 weighs 2.5 kg and goes to 18 Hill Street, Leeds.",
               {"tracking": "ZX-4471", "weight_kg": 2.5, "destination": {"street": "18 Hill Street", "city": "Leeds"}},
               (("Package QP-102, 4 kg, to 3 River Lane, Dublin.",
                 {"tracking": "QP-102", "weight_kg": 4, "destination": {"street": "3 River Lane", "city": "Dublin"}}),
                ("Ship box MN-88 (0.8 kg) to 51 King Road, Oxford.",
                 {"tracking": "MN-88", "weight_kg": 0.8, "destination": {"street": "51 King Road", "city": "Oxford"}}),
                ("Parcel TR-905 weighs 12 kg; deliver to 7 Bay Street, Sydney.",
                 {"tracking": "TR-905", "weight_kg": 12,
                  "destination": {"street": "7 Bay Street", "city": "Sydney"}}))),
    Extraction("employee", Employee, "Maria Lopez writes code in the engineering team.",
               {"name": "Maria Lopez", "department": "engineering"},
               (("Tom Reed sells our products; he is in sales.", {"name": "Tom Reed", "department": "sales"}),
                ("Nina Shah answers customer tickets in support.", {"name": "Nina Shah", "department": "support"}),
                ("Paul Kim runs ad campaigns for the marketing department.",
                 {"name": "Paul Kim", "department": "marketing"}))),
    Extraction("recipe", Recipe, "Pancakes take 20 minutes and need flour, eggs and milk.",
               {"dish": "Pancakes", "ingredients": ["flour", "eggs", "milk"], "minutes": 20},
               (("Guacamole: avocados, lime, salt. Ready in 10 minutes.",
                 {"dish": "Guacamole", "ingredients": ["avocados", "lime", "salt"], "minutes": 10}),
                ("Tomato soup needs tomatoes and onions and cooks for 35 minutes.",
                 {"dish": "Tomato soup", "ingredients": ["tomatoes", "onions"], "minutes": 35}),
                ("Make an omelette in 5 minutes with eggs and cheese.",
                 {"dish": "omelette", "ingredients": ["eggs", "cheese"], "minutes": 5}))),
    Extraction("forecast", Forecast, "Oslo tomorrow: 4 degrees C, snowy and windy.",
               {"city": "Oslo", "temperature_c": 4, "condition": "snowy", "windy": True},
               (("Madrid will be sunny at 30 degrees C with calm air.",
                 {"city": "Madrid", "temperature_c": 30, "condition": "sunny", "windy": False}),
                ("Expect rain in London, 12 degrees C, strong winds.",
                 {"city": "London", "temperature_c": 12, "condition": "rainy", "windy": True}),
                ("Cloudy in Berlin, 18 degrees C, no wind.",
                 {"city": "Berlin", "temperature_c": 18, "condition": "cloudy", "windy": False}))),
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One prompt of the quality set: ``prompt``'s model asked about ``text``, whose answer is ``answer``."""
    name: str
    prompt: Extraction
    text: str
    answer: dict[str, Any]


QUALITY_SET: tuple[Case, ...] = tuple(Case(f"{p.name}-{i}", p, text, answer) for p in PROMPTS + MORE_PROMPTS
                                      for i, (text, answer) in enumerate(p.cases()))


def messages(p: Extraction, text: str | None = None) -> list[dict[str, str]]:
    """The chat of one extraction: ``p``'s own text, or ``text`` (one of ``p.more``)."""
    fields = ", ".join(p.model.model_fields)
    return [{"role": "user", "content": f"Extract {fields} as JSON from: {text or p.text}"}]


def strict_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON schema the ``openai`` client sends for ``response_format=model`` (strict): pydantic's,
    with every object closed (``additionalProperties: false``) and all its properties required."""
    schema = model.model_json_schema()

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and isinstance(node.get("properties"), dict):
                node["additionalProperties"] = False
                node["required"] = list(node["properties"])
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def is_right(p: Extraction, parsed: BaseModel | None) -> bool:
    return parsed is not None and answer_is_right(parsed.model_dump(mode="json"), p.answer)
