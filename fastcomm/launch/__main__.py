"""``python -m fastcomm.launch``: the same as the ``fastcomm-run`` console script."""

from .cli import run

if __name__ == "__main__":
    run()
