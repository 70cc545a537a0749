"""Test helpers: seeded tiny real-architecture models and pipelines, shared checks."""
