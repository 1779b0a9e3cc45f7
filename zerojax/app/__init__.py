"""The application: `train.py`'s whole job (trainer, run folders, reports, monitor, sample) and the
`zerojax` command line."""
