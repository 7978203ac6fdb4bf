"""`python -m syncline`: the command line of `syncline.trainer.cli`."""

from syncline.trainer.cli import main

if __name__ == "__main__":
    main()
