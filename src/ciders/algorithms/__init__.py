"""Update rules, one module per paper: pure functions over explicit state (dataclasses)."""
