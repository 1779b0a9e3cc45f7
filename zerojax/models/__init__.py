"""Models shipped with zerojax (the embedded GPT used by train.py, examples and tests)."""
