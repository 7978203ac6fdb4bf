"""`python -m trainer`: the command line of `trainer.cli`."""

from trainer.cli import main

if __name__ == "__main__":
    main()
