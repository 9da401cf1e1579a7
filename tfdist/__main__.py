"""``python -m tfdist`` runs the ``tfdist`` command."""

from tfdist.cli import main

__all__: list[str] = []

if __name__ == "__main__":
  main.console_main()
