"""Train with zerojax: `python train.py --config configs/zero3.yaml [--set key=value ...]`."""
import sys

from zerojax.app.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
