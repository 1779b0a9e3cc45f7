"""Tools over the library: the memory and step-time estimator, run plots, and the config reference."""
