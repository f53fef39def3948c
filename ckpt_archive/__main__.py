from ckpt_archive.cli.app import main

__all__ = []  # a script: nothing to import from it

main()
