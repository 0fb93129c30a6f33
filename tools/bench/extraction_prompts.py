"""Extraction prompts with pydantic models and known answers, as an application sends them through the
``openai`` client's ``chat.completions.parse(response_format=Model)`` (strict json_schema): the real-model
tests' (tests/vllm_engine/test_real_model.py) and ``maskd bench vllm --drafts``'s ``extraction`` workload.

Each prompt has more texts of the same kind (``more``, no known answer): the bench's later requests
of a schema, whose grammar drafts can use what the schema's earlier requests wrote."""
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


@dataclasses.dataclass(frozen=True)
class Extraction:
    name: str
    model: type[BaseModel]
    text: str
    answer: dict[str, Any]       # the fields a right answer has (compared case-insensitively)
    more: tuple[str, ...] = ()   # more texts for the same model (the bench's later requests)

    def texts(self) -> tuple[str, ...]:
        return (self.text, *self.more)


PROMPTS: tuple[Extraction, ...] = (
    Extraction("person", Person, "Alice is 31 years old.", {"name": "Alice", "age": 31},
               ("Bob is 45 years old.", "Carla, aged 27, joined the team.", "My grandfather Hugo turned 88 today.")),
    Extraction("city", City, "I flew to Lyon, a city in France, last spring.", {"city": "Lyon", "country": "France"},
               ("We moved to Osaka in Japan.", "The conference is in Porto, Portugal.",
                "She was born in Quebec, a city in Canada.")),
    Extraction("review", Review, "The Zephyr headphones broke after two days. Terrible.",
               {"product": "Zephyr headphones", "sentiment": "negative"},
               ("I love the Aurora lamp, it lights the whole room.", "The Nimbus kettle works. Nothing special.",
                "The Vega backpack is comfortable and sturdy, a great buy.")),
    Extraction("contact", Contact, "Write to Bob Stone at bob@stone.org, 12 Elm Street, Boston.",
               {"name": "Bob Stone", "email": "bob@stone.org",
                "address": {"street": "12 Elm Street", "city": "Boston"}},
               ("Contact Dana Cruz: dana@cruz.io, 4 Oak Road, Denver.",
                "Reach Eli Park at eli.park@mail.com, 77 Pine Avenue, Austin.",
                "Send it to Fay Lin, fay@lin.net, 9 Lake Drive, Seattle.")),
    Extraction("meeting", Meeting, "Budget review on Monday with Ann, Raj and Li.",
               {"title": "Budget review", "day": "Monday", "attendees": ["Ann", "Raj", "Li"]},
               ("Design sync on Tuesday with Omar and Kate.", "Quarterly planning on Friday with Sam, Ivy and Noah.",
                "Hiring review on Wednesday with Leo.")),
    Extraction("order", Order, "Order: 3 blue mugs, already paid.", {"item": "blue mugs", "quantity": 3, "paid": True},
               ("Order: 2 red chairs, not paid yet.", "Order: 10 notebooks, paid by card.",
                "Order: 1 desk lamp, payment pending.")),
    Extraction("book", Book, "Dune, written by Frank Herbert, came out in 1965.",
               {"title": "Dune", "author": "Frank Herbert", "year": 1965},
               ("Emma, by Jane Austen, was published in 1815.", "The Hobbit by J. R. R. Tolkien appeared in 1937.",
                "Neuromancer, a 1984 novel by William Gibson.")),
    Extraction("flight", Flight, "Book 2 seats from Paris to Rome.",
               {"origin": "Paris", "destination": "Rome", "passengers": 2},
               ("Book 5 seats from Berlin to Madrid.", "One ticket from Tokyo to Seoul, please.",
                "We need 3 seats from Cairo to Athens.")),
)


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
