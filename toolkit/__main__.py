"""`python -m toolkit demo ...`"""
import sys

from toolkit.demo import main

COMMANDS = {"demo": main}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m toolkit {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        sys.exit(2)
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
