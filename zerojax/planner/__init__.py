"""The one door for the config: it is read here, once, into a `Plan` of plain decisions (and a mesh),
which everything below takes instead of the config."""
