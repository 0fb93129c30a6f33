"""Extraction prompts with pydantic models and known answers, as an application sends them through the
``openai`` client's ``chat.completions.parse(response_format=Model)`` (strict json_schema)."""
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


PROMPTS: tuple[Extraction, ...] = (
    Extraction("person", Person, "Alice is 31 years old.", {"name": "Alice", "age": 31}),
    Extraction("city", City, "I flew to Lyon, a city in France, last spring.", {"city": "Lyon", "country": "France"}),
    Extraction("review", Review, "The Zephyr headphones broke after two days. Terrible.",
               {"product": "Zephyr headphones", "sentiment": "negative"}),
    Extraction("contact", Contact, "Write to Bob Stone at bob@stone.org, 12 Elm Street, Boston.",
               {"name": "Bob Stone", "email": "bob@stone.org",
                "address": {"street": "12 Elm Street", "city": "Boston"}}),
    Extraction("meeting", Meeting, "Budget review on Monday with Ann, Raj and Li.",
               {"title": "Budget review", "day": "Monday", "attendees": ["Ann", "Raj", "Li"]}),
    Extraction("order", Order, "Order: 3 blue mugs, already paid.", {"item": "blue mugs", "quantity": 3, "paid": True}),
    Extraction("book", Book, "Dune, written by Frank Herbert, came out in 1965.",
               {"title": "Dune", "author": "Frank Herbert", "year": 1965}),
    Extraction("flight", Flight, "Book 2 seats from Paris to Rome.",
               {"origin": "Paris", "destination": "Rome", "passengers": 2}),
)


def messages(p: Extraction) -> list[dict[str, str]]:
    fields = ", ".join(p.model.model_fields)
    return [{"role": "user", "content": f"Extract {fields} as JSON from: {p.text}"}]


def is_right(p: Extraction, parsed: BaseModel | None) -> bool:
    return parsed is not None and answer_is_right(parsed.model_dump(mode="json"), p.answer)
