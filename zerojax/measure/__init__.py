"""Reading compiled programs: collectives, work and layout bytes from XLA's HLO text."""
