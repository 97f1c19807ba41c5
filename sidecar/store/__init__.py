"""Durable state: ownership records, the generation, the in-memory table and the CDI specs."""
