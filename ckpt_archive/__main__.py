import sys

try:
    from ckpt_archive.cli.app import main
except KeyboardInterrupt:  # a Ctrl-C before the CLI's own answer to it is imported: the same line, exit 130
    sys.stderr.write("interrupted before anything was done; nothing was read or written\n")
    sys.exit(130)

__all__ = []  # a script: nothing to import from it

main()
